"""The demo swarm: a coordinator in-process, honest workers and every kind of cheater."""
