"""TEMPORARY re-export for tests and bench not yet moved: import from frontend.model_resolution. Delete with them."""
from frontend.model_resolution import config_from_dir, resolve_model, short_model  # noqa: F401
from protocol.config import check_tp_size  # noqa: F401
