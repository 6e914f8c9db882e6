"""The toy paged-attention model and chat trace behind ``kvshm demo``.

``kvshm.demo.model`` needs torch; ``kvshm.demo.trace`` does not. Nothing is imported
here, so importing ``kvshm.demo`` is free.
"""

__all__: list[str] = []  # nothing imported here (see above)
