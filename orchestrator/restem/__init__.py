"""ReST^EM iterations: sample N per problem under one policy, verify, keep at most K correct."""
