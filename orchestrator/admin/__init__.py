"""Operator authentication (bearer tokens with roles) and the admin API."""
