"""The face's private machinery: what the PopTorch API modules at the top level are built from."""
