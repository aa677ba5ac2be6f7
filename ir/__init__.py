"""The IR: values, nodes, graphs and types; the op registry; layouts and sharding rules; the
text printer, parser and verifier."""
