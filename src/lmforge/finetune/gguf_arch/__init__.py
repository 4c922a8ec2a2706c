"""Moved to lmforge.export.gguf_arch: exporting a run is no fine-tuning step (pretrained runs are exported
too), so the exporters have their own package, lmforge.export. This old import path stays for one release
and is the new module itself (lmforge.utils.renamed)."""

from lmforge.utils.renamed import renamed

renamed(__name__, "lmforge.export.gguf_arch", package=True)
