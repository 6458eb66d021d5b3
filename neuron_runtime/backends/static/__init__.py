"""The static-shape engine path: steps padded to buckets, one compiled graph per bucket."""
