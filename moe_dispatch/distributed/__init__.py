"""Running on several ranks: process groups and collectives (``comm``), which layer and step a
collective belongs to (``identity``), agreement across ranks and errors that every rank raises
together (``agreement``), starting the ranks of a single-machine run (``launch``), and the
process-wide tables keyed by group (``registry``)."""
