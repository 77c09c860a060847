#!/usr/bin/env python3
"""Fault-injection suite: breaks short resnet_ddp training jobs on purpose
and checks that each one ends the way a user needs it to.

Cases (each drawn with a seeded RNG, so a run is reproducible):
  kill9-launcher     SIGKILL a random rank at a random moment, job under //tools:launch
  kill9-bare         the same with every rank started by hand (no launcher: srun, several nodes)
  sigstop-launcher   SIGSTOP a random rank (alive but stuck) under the launcher
  sigstop-bare       the same without a launcher; then SIGCONT it: it must leave too
  crash-<stage>      rank 0 killed at a stage of a checkpoint save (EMBER_FAULT_CHECKPOINT)
  corrupt-<how>      the newest (sharded) checkpoint damaged (a truncated rank file, garbage
                     trainer.json, a missing rank file), then --resume
  bad-data           a truncated IDX file in the dataset directory

Every case asserts: the exit status (non-zero, and the launcher's 128+9 for a
SIGKILL it saw), the named cause in the output, the time from the fault to the
last process leaving, no process of the case left behind (found through an
environment marker), and that the newest complete checkpoint still loads
(resnet_ddp --resume with nothing left to train, which loads and exits 0).

  tools/fault_suite.py --bin-dir bazel-bin            # the full suite (about 40 cases)
  tools/fault_suite.py --bin-dir bazel-bin --smoke    # one case of each kind (CI)
Prints one line per case and a table (kind, cases, passed, worst time to exit).
"""
import argparse
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid

STAGES = ["sharded_rank_written", "sharded_before_index", "exchanged", "old_moved_aside", "renamed"]
CORRUPTIONS = ["truncated-shard", "garbage-trainer-json", "missing-shard"]
WORLD = 2
TIMEOUT_S = 4  # collective timeout for the SIGSTOP cases (alive-but-stuck detection)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def marked_pids(marker):
    """Processes whose environment carries this case's marker."""
    pids = []
    needle = ("EMBER_FAULT_CASE=" + marker).encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/environ" % d, "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(d))
        except OSError:
            pass
    return pids


def env_of(key, value):
    return [line.split(b"=", 1)[1].decode() for line in value if line.startswith(key.encode() + b"=")]


def rank_pids(marker):
    """{rank: pid} of the training workers of a case (the launcher has no RANK)."""
    out = {}
    for pid in marked_pids(marker):
        try:
            with open("/proc/%d/environ" % pid, "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        r = env_of("RANK", env)
        if r:
            out[int(r[0])] = pid
    return out


class Case:
    def __init__(self, kind, suite):
        self.kind, self.suite = kind, suite
        self.marker = uuid.uuid4().hex
        self.dir = tempfile.mkdtemp(prefix="ember_fault_", dir=suite.tmp)
        self.ckpt = os.path.join(self.dir, "ckpt")
        self.problems = []
        self.exit_s = None
        self.note = ""
        self.logs = []

    def env(self, extra=None):
        e = dict(os.environ)
        e["EMBER_FAULT_CASE"] = self.marker
        e.pop("RANK", None)
        e.pop("WORLD_SIZE", None)
        if extra:
            e.update(extra)
        return e

    def train_args(self, epochs=3, steps=20, extra=()):
        return ["--data", self.suite.data, "--batch-size", "16", "--max-steps", str(steps), "--eval-size", "64",
                "--workers", "0", "--epochs", str(epochs), "--checkpoint-dir", self.ckpt, *extra]

    def log(self, name):
        """A file for a process's output (a pipe could fill up and stall it)."""
        f = open(os.path.join(self.dir, name + ".log"), "w")
        self.logs.append(f.name)
        return f

    def output(self):
        text = ""
        for name in self.logs:
            with open(name, errors="replace") as f:
                text += f.read()
        return text

    def check(self, ok, what):
        if not ok:
            self.problems.append(what)

    def no_orphans(self):
        left = marked_pids(self.marker)
        if left:
            self.problems.append("processes left behind: %s" % left)
            for p in left:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass

    def newest_checkpoint_loads(self):
        epochs = sorted(int(d[6:]) for d in os.listdir(self.ckpt) if d.startswith("epoch_") and d[6:].isdigit()) \
            if os.path.isdir(self.ckpt) else []
        if not epochs:
            self.note += " (no checkpoint written before the fault)"
            return
        # Nothing left to train: resume loads the newest checkpoint and exits.
        p = subprocess.run([self.suite.resnet, "--nproc", str(WORLD), *self.train_args(epochs=epochs[-1]),
                            "--resume"], env=self.env(), capture_output=True, text=True, timeout=120)
        self.check(p.returncode == 0 and "resumed from" in p.stdout + p.stderr,
                   "the newest checkpoint (epoch_%d) does not load: rc %d: %s" % (
                       epochs[-1], p.returncode, (p.stdout + p.stderr)[-600:]))

    def good_run(self, epochs=2):
        p = subprocess.run([self.suite.resnet, "--nproc", str(WORLD), *self.train_args(epochs=epochs, steps=4)],
                           env=self.env(), capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise RuntimeError("the fault-free run failed: " + (p.stdout + p.stderr)[-800:])


def wait_all(procs, limit):
    """Waits for every Popen until `limit` (monotonic); returns when the last exited (or None)."""
    last = None
    for p in procs:
        try:
            p.wait(timeout=max(0.0, limit - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None
        last = time.monotonic()
    return last


def start_bare(case, extra_env=None, extra_args=()):
    """WORLD ranks started by hand with torchrun's variables: nobody supervises them."""
    port = free_port()
    procs = []
    for r in range(WORLD):
        env = case.env({"RANK": str(r), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(r),
                        "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "OMP_NUM_THREADS": "1", **(extra_env or {})})
        procs.append(subprocess.Popen([case.suite.resnet, *case.train_args(extra=extra_args)], env=env,
                                      stdout=case.log("rank%d" % r), stderr=subprocess.STDOUT))
    return procs


def start_launched(case, extra_args=()):
    port = free_port()
    return subprocess.Popen([case.suite.launch, "--nproc_per_node=%d" % WORLD, "--master_port=%d" % port, "--",
                             case.suite.resnet, *case.train_args(extra=extra_args)], env=case.env(),
                            stdout=case.log("launcher"), stderr=subprocess.STDOUT)


def wait_for_ranks(case, deadline):
    while time.monotonic() < deadline:
        pids = rank_pids(case.marker)
        if len(pids) == WORLD:
            return pids
        time.sleep(0.02)
    return rank_pids(case.marker)


def signal_case(case, rng, sig, launcher):
    extra = ("--timeout", str(TIMEOUT_S)) if sig == signal.SIGSTOP else ()
    procs = [start_launched(case, extra)] if launcher else start_bare(case, extra_args=extra)
    pids = wait_for_ranks(case, time.monotonic() + 20)
    victim = rng.randrange(WORLD)
    time.sleep(rng.uniform(0.3, 2.0))  # a random point: rendezvous, a step, an eval or a save
    if any(p.poll() is not None for p in procs) or victim not in pids:
        case.note = " (job ended before the fault: not counted)"
        for p in procs:
            p.kill()
        return None
    t_fault = time.monotonic()
    os.kill(pids[victim], sig)
    budget = 10 if sig == signal.SIGKILL else TIMEOUT_S + 15
    survivors = procs if launcher else [p for r, p in enumerate(procs) if r != victim]
    last = wait_all(survivors, t_fault + budget)
    out = case.output()
    if last is None:
        case.problems.append("still running %d s after the fault" % budget)
        for p in procs:
            p.kill()
        return None
    case.exit_s = last - t_fault
    if not launcher and all(p.returncode == 0 for p in survivors):
        # Every survivor finished its last collective, so the victim had too:
        # the fault came after the job's end (its last checkpoint's commit,
        # its exit), not in the middle of it.
        case.note = " (every survivor had finished before the fault: not counted)"
        procs[victim].wait(timeout=20)
        return None
    for p in survivors:
        case.check(p.returncode != 0, "exit status 0 after a rank was %s" % sig.name)
    if sig == signal.SIGKILL:
        if launcher:
            case.check(procs[0].returncode == 128 + 9 or "rank %d" % victim in out,
                       "the launcher's status is %d, not 137, and names no rank" % procs[0].returncode)
            case.check("rank %d" % victim in out and ("SIGKILL" in out or "signal 9" in out),
                       "the output does not name rank %d and SIGKILL: %s" % (victim, out[-800:]))
        else:
            named = ("rank %d (connection from" % victim in out and "left the job" in out) or \
                    (victim == 0 and "store server closed the connection" in out)
            case.check(named, "the survivors do not name dead rank %d: %s" % (victim, out[-800:]))
    else:
        # A stopped rank 0 also stops the store it hosts: its peers' store
        # calls then go unanswered, which they say.
        case.check("timed out" in out or "did not reach" in out or "no reply from the store server" in out,
                   "no timeout named for the stopped rank: %s" % out[-800:])
        case.check(("timeout %d ms" % (TIMEOUT_S * 1000)) in out, "the timeout's value is not named")
        if not launcher:
            # Woken up, the stopped rank finds its peers gone and leaves too.
            os.kill(pids[victim], signal.SIGCONT)
            try:
                procs[victim].wait(timeout=20)
                case.check(procs[victim].returncode != 0, "the resumed rank exited 0")
            except subprocess.TimeoutExpired:
                case.problems.append("the stopped rank, continued, did not leave within 20 s")
                procs[victim].kill()
    return True


def crash_case(case, stage):
    case.good_run()  # epoch_1 and epoch_2 exist: the next saves replace them (exchange / move aside)
    if stage == "renamed":
        # "renamed" is the plain rename of a first save: no epoch_2 yet.
        shutil.rmtree(os.path.join(case.ckpt, "epoch_2"))
    env = case.env({"EMBER_FAULT_CHECKPOINT": stage + ":2"})
    t0 = time.monotonic()
    p = subprocess.run([case.suite.resnet, "--nproc", str(WORLD), *case.train_args(epochs=2, steps=4), "--overwrite"],
                       env=env, capture_output=True, text=True, timeout=120)
    # The fault is the save of epoch 2, near the end of the run: time from it
    # is not measurable from outside; the run's own length bounds it.
    case.exit_s = time.monotonic() - t0
    case.check(case.exit_s < 30, "the crashed run took %.1f s to end" % case.exit_s)
    out = p.stdout + p.stderr
    case.check(p.returncode != 0, "exit status 0 although rank 0 was killed while saving")
    case.check("rank 0" in out and ("SIGKILL" in out or "signal 9" in out),
               "the output does not name rank 0's SIGKILL: " + out[-600:])
    return True


def corrupt_case(case, how):
    case.good_run()
    newest = os.path.join(case.ckpt, "epoch_2")
    if how == "truncated-shard":
        f = os.path.join(newest, "rank-00000.safetensors")
        os.truncate(f, os.path.getsize(f) // 2)
        name = "rank-00000.safetensors"
    elif how == "garbage-trainer-json":
        with open(os.path.join(newest, "trainer.json"), "r+b") as f:
            f.seek(40)
            f.write(b"\x00garbage{[")
        name = "trainer.json"
    else:
        os.remove(os.path.join(newest, "rank-00001.safetensors"))
        name = "rank-00001.safetensors"
    t0 = time.monotonic()
    p = subprocess.run([case.suite.resnet, "--nproc", str(WORLD), *case.train_args(epochs=3, steps=4), "--resume"],
                       env=case.env(), capture_output=True, text=True, timeout=120)
    case.exit_s = time.monotonic() - t0
    out = p.stdout + p.stderr
    case.check(case.exit_s < 10, "the damaged checkpoint took %.1f s to report" % case.exit_s)
    case.check(p.returncode != 0, "resumed from a damaged checkpoint")
    case.check(os.path.join(newest, name) in out or (name == "trainer.json" and newest in out),
               "the error does not name %s: %s" % (os.path.join(newest, name), out[-600:]))
    # Asked for, the previous checkpoint is used (with a warning).
    p = subprocess.run([case.suite.resnet, "--nproc", str(WORLD), *case.train_args(epochs=1, steps=4), "--resume",
                        "--resume-fallback"], env=case.env(), capture_output=True, text=True, timeout=120)
    case.check(p.returncode == 0 and "epoch_1" in p.stdout + p.stderr,
               "--resume-fallback does not load epoch_1: " + (p.stdout + p.stderr)[-600:])
    return "no-load-check"


def write_idx_dataset(root, n_train=64, n_test=32):
    os.makedirs(root, exist_ok=True)
    rng = random.Random(7)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        with open(os.path.join(root, prefix + "-images-idx3-ubyte"), "wb") as f:
            f.write(struct.pack(">IIII", 0x803, n, 28, 28) + bytes(rng.randrange(256) for _ in range(n * 784)))
        with open(os.path.join(root, prefix + "-labels-idx1-ubyte"), "wb") as f:
            f.write(struct.pack(">II", 0x801, n) + bytes(rng.randrange(10) for _ in range(n)))


def bad_data_case(case):
    root = os.path.join(case.dir, "data")
    write_idx_dataset(root)
    images = os.path.join(root, "train-images-idx3-ubyte")
    os.truncate(images, 16 + 784 * 10 + 100)  # the header promises 64 images
    t0 = time.monotonic()
    p = subprocess.run([case.suite.resnet, "--nproc", str(WORLD), "--data", root, "--batch-size", "8",
                        "--max-steps", "2", "--eval-size", "8", "--workers", "0", "--epochs", "1",
                        "--checkpoint-dir", case.ckpt], env=case.env(), capture_output=True, text=True, timeout=120)
    case.exit_s = time.monotonic() - t0
    out = p.stdout + p.stderr
    case.check(case.exit_s < 10, "the truncated file took %.1f s to report" % case.exit_s)
    case.check(p.returncode != 0, "trained on a truncated dataset")
    case.check(images in out, "the error does not name %s: %s" % (images, out[-600:]))
    return "no-load-check"


class Suite:
    def __init__(self, args):
        # The example with the fault-injection harness linked in (tools/fault_hooks.cc).
        self.resnet = os.path.abspath(args.resnet or os.path.join(args.bin_dir, "tools/resnet_ddp_faults"))
        self.launch = os.path.abspath(args.launch or os.path.join(args.bin_dir, "tools/launch"))
        self.data = "synthetic"
        self.tmp = tempfile.mkdtemp(prefix="ember_fault_suite_", dir=os.environ.get("TEST_TMPDIR"))


def run_case(suite, kind, rng):
    case = Case(kind, suite)
    try:
        if kind == "kill9-launcher":
            counted = signal_case(case, rng, signal.SIGKILL, True)
        elif kind == "kill9-bare":
            counted = signal_case(case, rng, signal.SIGKILL, False)
        elif kind == "sigstop-launcher":
            counted = signal_case(case, rng, signal.SIGSTOP, True)
        elif kind == "sigstop-bare":
            counted = signal_case(case, rng, signal.SIGSTOP, False)
        elif kind.startswith("crash-"):
            counted = crash_case(case, kind[len("crash-"):])
        elif kind.startswith("corrupt-"):
            counted = corrupt_case(case, kind[len("corrupt-"):])
        else:
            counted = bad_data_case(case)
        time.sleep(0.2)
        case.no_orphans()
        if counted is True:
            case.newest_checkpoint_loads()
    except Exception as e:  # a harness failure is a failed case, with its reason
        case.problems.append("harness: %r" % e)
        case.no_orphans()
        counted = True
    shutil.rmtree(case.dir, ignore_errors=True)
    return case, counted is not None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin-dir", default="bazel-bin", help="where examples/resnet_ddp and tools/launch are")
    ap.add_argument("--resnet", help="the resnet_ddp binary (default: BIN_DIR/examples/resnet_ddp)")
    ap.add_argument("--launch", help="the launcher binary (default: BIN_DIR/tools/launch)")
    ap.add_argument("--smoke", action="store_true", help="one case of each kind")
    ap.add_argument("--repeat", type=int, default=6, help="random signal cases of each kind (default 6)")
    ap.add_argument("--seed", type=int, default=2026)
    args = ap.parse_args()
    suite = Suite(args)
    rng = random.Random(args.seed)
    signal_kinds = ["kill9-launcher", "kill9-bare", "sigstop-launcher", "sigstop-bare"]
    kinds = [k for k in signal_kinds for _ in range(1 if args.smoke else args.repeat)]
    kinds += ["crash-" + s for s in (STAGES if not args.smoke else ["sharded_before_index", "old_moved_aside"])]
    kinds += ["corrupt-" + c for c in (CORRUPTIONS if not args.smoke else ["truncated-model"])]
    kinds += ["bad-data"]
    rows = {}
    failed = 0
    for kind in kinds:
        case, counted = run_case(suite, kind, rng)
        group = kind if not kind.startswith(("crash-", "corrupt-")) else kind.split("-")[0] + "-*"
        row = rows.setdefault(group, [0, 0, 0.0])
        status = "PASS" if not case.problems else "FAIL"
        t = "%.2f s" % case.exit_s if case.exit_s is not None else "-"
        print("%-28s %s  exit after %s%s" % (kind, status if counted else "SKIP", t, case.note), flush=True)
        for p in case.problems:
            print("    " + p, flush=True)
        if not counted:
            continue
        row[0] += 1
        if not case.problems:
            row[1] += 1
        else:
            failed += 1
        if case.exit_s is not None:
            row[2] = max(row[2], case.exit_s)
    print("\n| case | cases | passed | worst time to exit |\n|---|---|---|---|")
    for group, (n, ok, worst) in rows.items():
        print("| %s | %d | %d | %.1f s |" % (group, n, ok, worst))
    shutil.rmtree(suite.tmp, ignore_errors=True)
    print("\nfault suite: %d case(s) failed" % failed if failed else "\nfault suite: all cases passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
