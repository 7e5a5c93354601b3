"""`pipeline.mode: ray`: each role a group of Ray actor processes, one per host; the driver's
pool, the groups, the actors and the rows that travel between them."""
