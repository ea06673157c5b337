"""One module per benchmark group; bench/registry.py lists them."""
