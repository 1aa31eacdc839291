"""pdtopo runtime: serving engine, bootstrap server and PD disaggregation, one process each."""
