"""One client module per external system; library exceptions become ours here only."""
