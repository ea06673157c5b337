"""One module per benchmark group of issue 10; bench/registry.py lists them."""
