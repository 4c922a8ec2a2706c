"""The old name of `lmforge.jobserver` (the REST job service), kept importable for one release.

`api/` sat beside `serve/`, which is also an HTTP API, so the job service was renamed after what it holds.
`import lmforge.api.app` and `from lmforge.api.store import Store` still work and give the very module
objects of `lmforge.jobserver`, with one DeprecationWarning; submodules are aliased on demand, so this
imports no FastAPI and no job-server module until one is asked for (lmforge.utils.renamed)."""

from lmforge.utils.renamed import renamed

renamed(__name__, "lmforge.jobserver", package=True)
