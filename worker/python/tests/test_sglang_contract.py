"""Contract with SGLang 0.5.23, read from the pinned wheel's source (SGLang cannot be imported
here: `hicache_storage.py` imports torch at the top, and CI's venv has no torch).

The wheel is the one `worker/tools/python-venv.sh` downloads into the venv (`<venv>/wheels`), or
`$TANDEM_SGLANG_WHEEL`. These fail when SGLang changes: the abstract-method set of
`HiCacheStorage`, the v1 method signatures, the dynamic factory's required keys and constructor
call, the `interface_v1` switch, the `"allocator": "shm"` switch, the `HiCacheStorageConfig`
fields the backend reads, and the host-pool layouts `get_page_buffer_meta` serves.
"""

import ast
import glob
import inspect
import os
import sys
import zipfile

import pytest

from tandem_kv.sglang import TandemHiCacheStorage

ABSTRACT = {"get", "batch_get", "set", "batch_set", "exists"}


def wheel():
    w = os.environ.get("TANDEM_SGLANG_WHEEL")
    if not w:
        found = sorted(glob.glob(os.path.join(sys.prefix, "wheels", "sglang-0.5.23-*.whl")))
        w = found[0] if found else ""
    if not w or not os.path.isfile(w):
        pytest.fail("the sglang 0.5.23 wheel is missing: run worker/tools/python-venv.sh or set TANDEM_SGLANG_WHEEL")
    return w


@pytest.fixture(scope="module")
def src():
    with zipfile.ZipFile(wheel()) as z:
        def read(path):
            return z.read(path).decode()

        yield read


def cls(tree, name):
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def methods(c):
    return {f.name: f for f in c.body if isinstance(f, ast.FunctionDef)}


def test_the_abstract_method_set_and_v1_signatures(src):
    tree = ast.parse(src("sglang/srt/mem_cache/hicache_storage.py"))
    base = methods(cls(tree, "HiCacheStorage"))
    abstract = {n for n, f in base.items() if any(isinstance(d, ast.Name) and d.id == "abstractmethod" for d in f.decorator_list)}
    assert abstract == ABSTRACT, f"SGLang's abstract methods changed: {sorted(abstract)}"
    for name in sorted(ABSTRACT | {"batch_get_v1", "batch_set_v1", "batch_exists", "register_mem_pool_host", "on_host_pools_registered", "clear", "get_stats"}):
        ours = getattr(TandemHiCacheStorage, name, None)
        assert ours is not None and name in TandemHiCacheStorage.__dict__, f"{name} is not implemented"
        theirs = [a.arg for a in base[name].args.args]
        mine = list(inspect.signature(ours).parameters)
        assert mine == theirs, f"{name}: SGLang has {theirs}, we have {mine}"


def test_the_config_fields_the_backend_reads(src):
    tree = ast.parse(src("sglang/srt/mem_cache/hicache_storage.py"))
    fields = {n.target.id for n in cls(tree, "HiCacheStorageConfig").body if isinstance(n, ast.AnnAssign)}
    used = {"tp_rank", "tp_size", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size", "is_mla_model", "model_name", "extra_config"}
    assert used <= fields, f"missing: {used - fields}"


def test_the_dynamic_factory_keys_and_constructor_call(src):
    text = src("sglang/srt/mem_cache/storage/backend_factory.py")
    f = methods(cls(ast.parse(text), "StorageBackendFactory"))["_create_dynamic_backend"]
    body = ast.unparse(f)
    assert "required_fields = ['backend_name', 'module_path', 'class_name']" in body
    assert "backend_class(storage_config, kwargs)" in body
    assert "issubclass" in text and "HiCacheStorage" in text


def test_the_v1_and_shm_allocator_switches(src):
    cc = src("sglang/srt/managers/cache_controller.py")
    assert "self.storage_backend_type == 'dynamic' and bool(self.storage_config.extra_config.get('interface_v1', 0))" in ast.unparse(ast.parse(cc))
    common = ast.unparse(ast.parse(src("sglang/srt/mem_cache/pool_host/common.py")))
    assert "if backend == 'dynamic':" in common and "config.get('allocator') == 'shm'" in common


def test_the_host_pool_layouts_of_get_page_buffer_meta(src):
    mha = src("sglang/srt/mem_cache/pool_host/mha.py")
    f = methods(cls(ast.parse(mha), "MHATokenToKVPoolHost"))["get_page_buffer_meta"]
    body = ast.unparse(f)
    assert "if self.layout == 'layer_first':" in body
    assert "elif self.layout in ['page_first', 'page_first_direct', 'page_head']:" in body
