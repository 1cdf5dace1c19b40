"""A step's leaf types (engine-core process): the runner's spec, the flattened inputs and request states,
paged attention's metadata and kernels' torch references, and a step's results on the device by name.
They import nothing else of coreserve/worker/, so every other worker package may build on them."""
