"""The checks that run on this machine before any cluster starts: the data and model build, the state fits,
a resume matches."""
