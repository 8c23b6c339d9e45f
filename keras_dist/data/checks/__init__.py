"""What the input is checked for: the arguments of a call, and each batch."""
