"""What other libraries compute, for the tests to compare ours with: TRL's DPO numbers, transformers'
processors (in this process, and with torchvision in a child)."""
