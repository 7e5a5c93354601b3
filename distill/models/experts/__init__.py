"""The experts of a mixture-of-experts layer: grouped matmuls per backend (`grouped`,
the Hopper kernels in `mosaic`) and the expert-parallel dispatch (`dispatch`)."""
