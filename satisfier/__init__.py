"""satisfier package of tierfs."""
