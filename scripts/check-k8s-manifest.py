"""Checks docs/k8s-indexed-job.yaml without a cluster: it parses as YAML, is an Indexed Job,
runs `upscale --shard auto`, and gives UPSCALE_SHARD_COUNT equal to `completions` (a
mismatch would leave shards unprocessed or refused). kubectl's client-side dry run needs an
API server to map the kind, so it cannot check the file offline."""

import sys

import yaml

path = sys.argv[1] if len(sys.argv) > 1 else "docs/k8s-indexed-job.yaml"
with open(path) as f:
    job = yaml.safe_load(f)

assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job", "not a batch/v1 Job"
spec = job["spec"]
assert spec["completionMode"] == "Indexed", "completionMode must be Indexed"
(container,) = spec["template"]["spec"]["containers"]
args = container["command"] + container["args"]
assert args[0] == "upscale", args
shard = args[args.index("--shard") + 1]
env = {e["name"]: e["value"] for e in container.get("env", [])}
if shard == "auto":
    count = int(env["UPSCALE_SHARD_COUNT"])
else:
    assert shard.startswith("auto/"), shard
    count = int(shard.split("/")[1])
assert count == spec["completions"], f"N={count} but completions={spec['completions']}"
assert spec["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
print(f"{path}: Indexed Job of {count} completions running upscale --shard {shard}")
