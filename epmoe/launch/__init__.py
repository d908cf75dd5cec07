"""`python -m epmoe.launch`: run a model's MoE stack on N ranks (in-process for one rank,
Ray actors otherwise) and report correctness, time and balance."""
