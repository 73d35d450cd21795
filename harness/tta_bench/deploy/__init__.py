"""Deployment: the standalone ``Adapter``, the ``predict`` batch job and the ``serve``
HTTP service, over the same methods as the benchmark."""
