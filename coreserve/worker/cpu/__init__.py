"""The CPU backend (engine-core process): C kernels built and loaded at run time (`build`, `bindings`,
`kernels`, sources in `csrc/`), the few-row products (`linear`), the fused decode forward and the
huge-page placement of the weights."""
