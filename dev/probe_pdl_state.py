"""Whether the slow state of programmatic launches is the CUDA driver's, what enters it, and what leaves it
(one device run, ~1 min; its outcome goes in docs/lab-notes/launch-overhead-pdl.md):

    python -m dev.probe_pdl_state [--actions join,joindestroy,graph,waitonly,samejoin] [--links 80] ...

Measured (2026-11-28): our GPT-2 step's programmatic launches (PDL) reach the SMs ~0.35 us later, for good and
process-wide, once a PyTorch process has joined a few other streams into its own or captured a few graphs
(H200, B16 step 289 -> 303 us). This probe asks the same question without PyTorch: a standalone CUDA
program (written to a temporary folder, built with nvcc, nothing written into the checkout) times one CUDA
graph of --links dependent kernels, each launched with programmatic stream serialization: a kernel spins
--pre cycles (its pre-wait work, as our kernels' weight fetch), waits for the previous kernel
(griddepcontrol.wait), spins --body cycles and triggers its dependent (griddepcontrol.launch_dependents,
the late trigger). The graph is captured on a stream of its own and replayed on the legacy default stream,
as PyTorch does. Per action (one process each) it prints the us a link young, after each of --repeat
repetitions of the action (young and after the last, also replayed on a stream of the greatest priority),
after the program destroys what the actions created, and after cudaDeviceReset (a new context, the graph
built again):

- join: a fresh non-blocking stream that waits for the default stream, runs an empty kernel, and is waited
  for by the default stream (PyTorch's `wait_stream` both ways around a side-stream op);
- joindestroy: the same, the stream and its events destroyed right after;
- samejoin: the same join, always with one extra stream created before the graph;
- waitonly: a fresh stream that waits for the default stream, nothing run on it, never joined back;
- graph: one more graph (one empty kernel) captured and instantiated, never launched.

A driver's state shows as the same step in us a link (from ~ --body cycles plus the launch hop to ~0.35
us more) after join / graph but not after waitonly, as the PyTorch probe found; a reset that brings back the
young figure says what, if anything, leaves it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                                        \
  do {                                                                                               \
    cudaError_t e_ = (x);                                                                            \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));        \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

__device__ __forceinline__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// One link: pre-wait work, the wait for the kernel before, the body, the late trigger.
__global__ void link_kernel(long long pre, long long body, int* sink) {
  spin(pre);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  spin(body);
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (threadIdx.x == 0 && blockIdx.x == 0) atomicAdd(sink, 1);
}

__global__ void empty_kernel(int*) {}

struct Chain {
  cudaStream_t capture = nullptr;
  cudaGraphExec_t exec = nullptr;
  int* sink = nullptr;
};

static Chain build_chain(int links, int blocks, long long pre, long long body) {
  Chain c;
  CK(cudaMalloc(&c.sink, sizeof(int)));
  CK(cudaStreamCreateWithFlags(&c.capture, cudaStreamNonBlocking));
  CK(cudaStreamBeginCapture(c.capture, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < links; ++i) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(128);
    cfg.stream = c.capture;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, link_kernel, pre, body, c.sink));
  }
  cudaGraph_t graph;
  CK(cudaStreamEndCapture(c.capture, &graph));
  CK(cudaGraphInstantiate(&c.exec, graph, 0));
  CK(cudaGraphDestroy(graph));
  return c;
}

static void destroy_chain(Chain& c) {
  CK(cudaGraphExecDestroy(c.exec));
  CK(cudaStreamDestroy(c.capture));
  CK(cudaFree(c.sink));
  c = Chain{};
}

// us a link: the median over `rounds` of `replays` back-to-back replays on `stream` (0: the legacy default).
static double time_chain(const Chain& c, int links, int replays, int rounds, cudaStream_t stream = 0) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> us;
  CK(cudaGraphLaunch(c.exec, stream));
  for (int r = 0; r < rounds; ++r) {
    CK(cudaEventRecord(a, stream));
    for (int i = 0; i < replays; ++i) CK(cudaGraphLaunch(c.exec, stream));
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, a, b));
    us.push_back(1e3 * ms / replays / links);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

struct Made {
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> events;
  std::vector<cudaGraphExec_t> execs;
};

static void join(cudaStream_t s, int* sink, Made& made, bool keep) {
  cudaEvent_t there, back;
  CK(cudaEventCreateWithFlags(&there, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&back, cudaEventDisableTiming));
  CK(cudaEventRecord(there, 0));
  CK(cudaStreamWaitEvent(s, there, 0));
  empty_kernel<<<1, 32, 0, s>>>(sink);
  CK(cudaGetLastError());
  CK(cudaEventRecord(back, s));
  CK(cudaStreamWaitEvent(0, back, 0));
  CK(cudaDeviceSynchronize());
  if (keep) {
    made.events.push_back(there);
    made.events.push_back(back);
  } else {
    CK(cudaEventDestroy(there));
    CK(cudaEventDestroy(back));
  }
}

static void act(const char* action, cudaStream_t same, int* sink, Made& made) {
  if (!std::strcmp(action, "join") || !std::strcmp(action, "joindestroy")) {
    const bool keep = !std::strcmp(action, "join");
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    join(s, sink, made, keep);
    if (keep) made.streams.push_back(s);
    else CK(cudaStreamDestroy(s));
  } else if (!std::strcmp(action, "samejoin")) {
    join(same, sink, made, true);
  } else if (!std::strcmp(action, "waitonly")) {
    cudaStream_t s;
    cudaEvent_t there;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaEventCreateWithFlags(&there, cudaEventDisableTiming));
    CK(cudaEventRecord(there, 0));
    CK(cudaStreamWaitEvent(s, there, 0));
    CK(cudaDeviceSynchronize());
    made.streams.push_back(s);
    made.events.push_back(there);
  } else if (!std::strcmp(action, "graph")) {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    empty_kernel<<<1, 32, 0, s>>>(sink);
    CK(cudaGetLastError());
    cudaGraph_t g;
    cudaGraphExec_t e;
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&e, g, 0));
    CK(cudaGraphDestroy(g));
    made.streams.push_back(s);
    made.execs.push_back(e);
  } else {
    std::fprintf(stderr, "action must be join, joindestroy, samejoin, waitonly or graph, got %s\n", action);
    std::exit(2);
  }
}

static void release(Made& made) {
  CK(cudaDeviceSynchronize());
  for (auto e : made.execs) CK(cudaGraphExecDestroy(e));
  for (auto e : made.events) CK(cudaEventDestroy(e));
  for (auto s : made.streams) CK(cudaStreamDestroy(s));
  made = Made{};
}

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr, "usage: probe ACTION LINKS BLOCKS PRE BODY REPEAT REPLAYS ROUNDS\n");
    return 2;
  }
  const char* action = argv[1];
  const int links = std::atoi(argv[2]), blocks = std::atoi(argv[3]);
  const long long pre = std::atoll(argv[4]), body = std::atoll(argv[5]);
  const int repeat = std::atoi(argv[6]), replays = std::atoi(argv[7]), rounds = std::atoi(argv[8]);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s: %s, %d links of %d blocks, pre %lld / body %lld cycles\n", action, prop.name, links, blocks,
              pre, body);
  cudaStream_t same;
  CK(cudaStreamCreateWithFlags(&same, cudaStreamNonBlocking));
  Chain c = build_chain(links, blocks, pre, body);
  // A stream of the greatest priority: whether the state is the default priority's hardware queue's.
  int least = 0, greatest = 0;
  CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t high;
  CK(cudaStreamCreateWithPriority(&high, cudaStreamNonBlocking, greatest));
  Made made;
  std::printf("%s young: %.3f us a link\n", action, time_chain(c, links, replays, rounds));
  std::printf("%s young, on a stream of priority %d: %.3f us a link\n", action, greatest,
              time_chain(c, links, replays, rounds, high));
  for (int i = 1; i <= repeat; ++i) {
    act(action, same, c.sink, made);
    std::printf("%s after %d: %.3f us a link\n", action, i, time_chain(c, links, replays, rounds));
  }
  std::printf("%s after %d, on the stream of priority %d: %.3f us a link\n", action, repeat, greatest,
              time_chain(c, links, replays, rounds, high));
  CK(cudaStreamDestroy(high));
  release(made);
  std::printf("%s after its streams, events and graphs are destroyed: %.3f us a link\n", action,
              time_chain(c, links, replays, rounds));
  destroy_chain(c);
  CK(cudaStreamDestroy(same));
  CK(cudaDeviceReset());
  c = build_chain(links, blocks, pre, body);
  std::printf("%s after cudaDeviceReset (a new context, the chain built again): %.3f us a link\n", action,
              time_chain(c, links, replays, rounds));
  destroy_chain(c);
  return 0;
}
"""

ACTIONS = ("join", "joindestroy", "samejoin", "waitonly", "graph")


def build(folder: Path, arch: str) -> Path:
    """The probe built with nvcc (fused_attn.build's toolkit) into `folder`."""
    from fused_attn.build import find_cuda_home

    src, exe = folder / "probe_pdl_state.cu", folder / "probe_pdl_state"
    src.write_text(SOURCE)
    nvcc = find_cuda_home() / "bin" / "nvcc"
    subprocess.run([str(nvcc), f"-arch={arch}", "-O2", "-std=c++17", "-o", str(exe), str(src)], check=True)
    return exe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dev.probe_pdl_state", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--actions", default=",".join(ACTIONS), help=f"comma list of {', '.join(ACTIONS)}")
    ap.add_argument("--links", type=int, default=80, help="kernels in the graph")
    ap.add_argument("--blocks", type=int, default=132, help="blocks a kernel")
    ap.add_argument("--pre", type=int, default=1000, help="cycles each block spins before its wait")
    ap.add_argument("--body", type=int, default=2000, help="cycles each block spins after its wait")
    ap.add_argument("--repeat", type=int, default=6, help="repetitions of the action")
    ap.add_argument("--replays", type=int, default=50, help="graph replays a timing round")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds (median)")
    ap.add_argument("--arch", default="sm_90a", help="nvcc's -arch (griddepcontrol needs sm_90 or later)")
    ap.add_argument("--build-only", action="store_true", help="build the probe and stop (no GPU needed)")
    args = ap.parse_args(argv)
    actions = args.actions.split(",")
    for a in actions:
        if a not in ACTIONS:
            raise SystemExit(f"--actions must name {', '.join(ACTIONS)}, got {a!r}")
    with tempfile.TemporaryDirectory(prefix="probe_pdl_state_") as tmp:
        exe = build(Path(tmp), args.arch)
        if args.build_only:
            print(f"built {exe.name} for {args.arch}")
            return 0
        bad = 0
        for a in actions:  # one process an action: each starts young
            run = subprocess.run([str(exe), a, str(args.links), str(args.blocks), str(args.pre), str(args.body),
                                  str(args.repeat), str(args.replays), str(args.rounds)], capture_output=True,
                                 text=True)
            print(run.stdout, end="")
            if run.returncode != 0:
                print(run.stderr, end="", file=sys.stderr)
                bad = 1
        return bad


if __name__ == "__main__":
    sys.exit(main())
