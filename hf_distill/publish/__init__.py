"""What leaves the run: the results report (`report`), the model card (`card`), Hub pushes (`hub`), plots
(`plots`) and size and speed measurements (`measure`)."""
