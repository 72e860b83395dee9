"""tandem-kv: the Python client of Tandem's engine API, and engine adapters on it.

- `tandem_kv.EngineClient` — connect, attach (pool fds by SCM_RIGHTS), health, tiers, prefill calls.
- `tandem_kv.errors` — typed exceptions, one per `ErrorReason`.
- `tandem_kv.sglang.TandemHiCacheStorage` — SGLang HiCache L3 backend (`--hicache-storage-backend dynamic`).
"""

from . import errors
from ._pb import engine_pb2 as pb
from .client import Attached, EngineClient, engine_identity, model_identity

__all__ = ["Attached", "EngineClient", "engine_identity", "errors", "model_identity", "pb"]
