"""The bounded streaming operators, one module each."""
