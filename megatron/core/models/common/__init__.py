"""Building blocks shared by models."""
