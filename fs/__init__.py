"""fs package of tierfs."""
