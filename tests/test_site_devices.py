"""A site's devices as operators configure and see them: `[node.mesh]` and `[node.cluster]` (file,
environment, a scheduler's variables, errors naming the key), and `devices` on /status."""



import pytest

from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest, SyncSpec
from diloco_node.config.settings import ConfigError, load_config
from diloco_node.config.site_devices import HEARTBEAT_TIMEOUT_S, ClusterSpec, MeshShape
from diloco_node.daemon.site_model import build_site_model
from diloco_node.ops.status import StatusBuilder, StatusDocument, render_metrics

from conftest import write_node_toml


def test_mesh_and_cluster_tables_from_the_file_the_environment_and_the_scheduler(tmp_path):
    path = write_node_toml(tmp_path, '[node.mesh]\nfsdp = 2\nmicrobatches = 4\n'
                                     '[node.cluster]\ncoordinator = "10.0.0.1:7400"\nnum_processes = 2\n')
    effective = load_config(path, {"SLURM_PROCID": "1", "DILOCO_MESH_DATA": "2"})
    assert effective.node.mesh == MeshShape(data=2, fsdp=2, microbatches=4)
    assert effective.node.cluster == ClusterSpec("10.0.0.1:7400", 2, 1)
    assert effective.sources["cluster.process_id"] == "env:SLURM_PROCID"
    assert effective.sources["mesh.data"] == "env:DILOCO_MESH_DATA"
    shown = {s.key: (s.value, s.env) for s in effective.settings()}
    assert shown["mesh.fsdp"] == (2, "DILOCO_MESH_FSDP")
    assert shown["cluster.process_id"] == (1, "DILOCO_CLUSTER_PROCESS_ID")
    # The node's own setting wins over the scheduler's variable.
    assert load_config(path, {"SLURM_PROCID": "1", "DILOCO_CLUSTER_PROCESS_ID": "0"}).node.cluster.process_id == 0
    defaults = load_config(write_node_toml(tmp_path, ""), {}).node
    assert defaults.mesh == MeshShape(data=-1, fsdp=1, microbatches=1) and not defaults.cluster.enabled
    assert defaults.cluster.heartbeat_timeout_s == HEARTBEAT_TIMEOUT_S
    assert load_config(path, {"DILOCO_CLUSTER_HEARTBEAT_TIMEOUT_S": "12"}).node.cluster.heartbeat_timeout_s == 12


@pytest.mark.parametrize("text, environ, message", [
    ("[node.mesh]\nfdsp = 2\n", {}, "node.mesh.fdsp .*unknown key; known in \\[node.mesh\\]: data, fsdp, microbatches"),
    ("[node.mesh]\ndata = -1\nfsdp = -1\n", {}, "both -1"),
    ("", {"DILOCO_MESH_MICROBATCHES": "0"}, "mesh.microbatches = 0: must be an integer >= 1 "
                                           "\\[mesh.microbatches from env:DILOCO_MESH_MICROBATCHES\\]"),
    ("[node.cluster]\nnum_processes = 2\n", {}, "a multi-host site needs cluster.coordinator"),
    ("[node.cluster]\ncoordinator = \"h:1\"\nnum_processes = 2\n", {"DILOCO_CLUSTER_PROCESS_ID": "2"},
     "cluster.process_id = 2: must be in 0..cluster.num_processes - 1 = 1"),
    ("[node.cluster]\ncoordinator = \"nohost\"\n", {}, "cluster.coordinator = 'nohost': expected HOST:PORT"),
    ("", {"DILOCO_CLUSTER_HEARTBEAT_TIMEOUT_S": "0"},
     "cluster.heartbeat_timeout_s = 0: must be an integer >= 1 \\(seconds\\) "
     "\\[cluster.heartbeat_timeout_s from env:DILOCO_CLUSTER_HEARTBEAT_TIMEOUT_S\\]"),
])
def test_bad_device_settings_are_refused_naming_the_key(tmp_path, text, environ, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write_node_toml(tmp_path, text), environ)


@pytest.mark.parametrize("key, value, message", [
    ("attention", '"flash"', "mesh.attention = 'flash': must be one of auto, xla, cudnn, chunked, reference"),
    ("remat", '"some"', "mesh.remat = 'some': must be one of none, full, dots"),
    ("platform", '"cuda"', "mesh.platform = 'cuda': must be one of auto, cpu, gpu, tpu"),
    ("peak_tflops", "-1.0", "mesh.peak_tflops = -1.0: must be a number >= 0"),
])
def test_mesh_execution_keys_are_validated_naming_the_key(tmp_path, key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write_node_toml(tmp_path, f"[node.mesh]\n{key} = {value}\n"), {})
    chosen = load_config(write_node_toml(tmp_path, ""), {f"DILOCO_MESH_{key.upper()}": {
        "attention": "chunked", "remat": "dots", "platform": "cpu", "peak_tflops": "989.5"}[key]}).node.mesh
    assert getattr(chosen, key) == {"attention": "chunked", "remat": "dots", "platform": "cpu",
                                    "peak_tflops": 989.5}[key]


def test_a_site_that_expects_a_gpu_and_gets_cpu_jax_refuses_to_start():
    manifest = RunManifest(model=ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=1,
                                              d_model=64, d_ff=128),
                           inner=InnerOptimizer(batch_size=4, warmup_steps=1, total_steps=10),
                           sync=SyncSpec(fragments=2, period=4, overlap=1))
    with pytest.raises(ConfigError, match="mesh.platform = 'gpu', but JAX found 'cpu' devices; install JAX for "
                                          "CUDA into the site's venv: pip install -e '.\\[cuda12\\]'"):
        build_site_model(manifest, learner=True, mesh_shape=MeshShape(platform="gpu"))
    site = build_site_model(manifest, learner=True, mesh_shape=MeshShape(platform="cpu"))
    assert site.devices["platform"] == "cpu"


def test_the_sites_attention_and_remat_choices_are_what_its_learner_compiles():
    from flax import nnx

    manifest = RunManifest(model=ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=2,
                                              d_model=64, d_ff=128),
                           inner=InnerOptimizer(batch_size=4, warmup_steps=1, total_steps=10),
                           sync=SyncSpec(fragments=2, period=4, overlap=1))
    chosen = build_site_model(manifest, learner=True, mesh_shape=MeshShape(attention="chunked", remat="dots"))
    default = build_site_model(manifest, learner=True, mesh_shape=MeshShape())
    model = nnx.merge(chosen.inner.graphdef, chosen.inner.params)
    assert (model.remat, [b.attn.attention for b in model.blocks]) == ("dots", ["chunked", "chunked"])
    plain = nnx.merge(default.inner.graphdef, default.inner.params)
    assert (plain.remat, plain.blocks[0].attn.attention) == ("none", "auto")
    assert chosen.devices["attention"] == "chunked" and chosen.devices["remat"] == "dots"
    # The same model either way (its values: tests/test_attention.py): the same parameters.
    assert chosen.shapes == default.shapes


def test_status_shows_the_learners_devices_and_mesh():
    manifest = RunManifest(model=ModelSpec.of("llama", vocab_size=256, seq_len=16, size="1m", num_layers=1,
                                              d_model=64, d_ff=128),
                           inner=InnerOptimizer(batch_size=4, warmup_steps=1, total_steps=10),
                           sync=SyncSpec(fragments=2, period=4, overlap=1))
    site = build_site_model(manifest, learner=True, mesh_shape=MeshShape(data=1, fsdp=-1))
    assert site.devices == {"platform": "cpu", "count": 2, "processes": 1, "mesh": {"data": 1, "fsdp": 2},
                            "kind": "cpu", "attention": "auto", "remat": "none"}
    builder = StatusBuilder("site-a", "run-x", "learner", 0.0)
    builder.set_devices(site.devices)
    served = builder.document(1.0).to_dict()
    assert served["devices"] == {"platform": "cpu", "count": 2, "processes": 1, "mesh": {"data": 1, "fsdp": 2}}
    assert StatusDocument.from_dict(served).devices == builder.document(1.0).devices
    assert 'diloco_learner_devices{data="1",fsdp="2",platform="cpu",processes="1"} 2.0' in render_metrics(
        builder.document(1.0))
    with pytest.raises(ConfigError, match="inner.batch_size = 3"):
        build_site_model(RunManifest(model=manifest.model, inner=InnerOptimizer(batch_size=3, warmup_steps=1,
                                                                                  total_steps=10),
                                     sync=manifest.sync), learner=True)
