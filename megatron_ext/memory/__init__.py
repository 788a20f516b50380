"""A run's GPU memory before it starts: the memory plan of each rank, the activation and state bytes it
adds up, the meta-device ranks it builds, and the launcher's check against the GPU."""
