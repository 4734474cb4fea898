"""Run `kernels benchmark` (the hub's own benchmark CLI) on every kernel repo's `benchmarks/` and keep the output.

    python scripts/kernels_benchmark.py [repo ...] [--iterations N] [--warmup N]

Each repo is built first (scripts/build.py), then benchmarked as a local repo, exactly as
`kernels benchmark ./kernel_repos/<repo> --output <file>` does. Writes $OUT/kernels_benchmark.json (every repo's
JSON result, keyed by repo) and $OUT/kernels_benchmark.log (the CLI's tables); OUT defaults to ./out.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "torch-ext"))

from hubfuse.build import families  # noqa: E402

REPOS = [name for name, repo in families(ROOT).items() if (repo / "benchmarks").is_dir()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repos", nargs="*", default=REPOS, help=f"default: all ({', '.join(REPOS)})")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    unknown = sorted(set(args.repos) - set(REPOS))
    if unknown:
        sys.exit(f"unknown repo(s) {unknown}; known: {REPOS}")
    out = Path(os.environ.get("OUT", ROOT / "out"))
    out.mkdir(parents=True, exist_ok=True)
    # the CLI imports its signature checker (cryptography) at start-up: say so once instead of failing per repo
    probe = subprocess.run([sys.executable, "-c", "import kernels.cli"], capture_output=True, text=True)
    if probe.returncode != 0:
        msg = (f"the kernels CLI does not import here: {probe.stderr.strip().splitlines()[-1]}\n(on the GPU image: "
               f"carry the cryptography, cffi and pycparser wheels in .whl; see docs/benchmarks.md)")
        (out / "kernels_benchmark.log").write_text(msg + "\n")
        sys.exit(msg)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), *args.repos], check=True, cwd=ROOT)
    results, failed = {}, []
    with open(out / "kernels_benchmark.log", "w") as log, tempfile.TemporaryDirectory() as tmp:
        for i, repo in enumerate(args.repos, 1):
            print(f"[{i}/{len(args.repos)}] kernels benchmark ./kernel_repos/{repo}", flush=True)
            t0 = time.time()
            result = Path(tmp) / f"{repo}.json"
            # the CLI's entry point, run with this interpreter (a --target install has no `kernels` script)
            cmd = [sys.executable, "-c", "import sys; from kernels.cli import main; sys.exit(main())", "benchmark",
                   str(families(ROOT)[repo]), "--iterations", str(args.iterations), "--warmup", str(args.warmup),
                   "--output", str(result)]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            text = proc.stdout + proc.stderr
            log.write(f"=== {repo} (exit {proc.returncode}, {time.time() - t0:.0f} s)\n{text}\n")
            log.flush()
            print(text[-4000:], flush=True)
            if proc.returncode != 0 or not result.exists():
                failed.append(repo)
                continue
            results[repo] = json.loads(result.read_text())
    (out / "kernels_benchmark.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'kernels_benchmark.json'}; failed: {failed or 'none'}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
