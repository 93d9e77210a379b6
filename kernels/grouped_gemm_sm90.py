"""Hopper (sm_90a) MoE grouped GEMM in CuTeDSL: ``out[e] = x_e @ W[e]^T``.

One persistent, warp-specialised kernel serves every variant:

* operand types: bf16 x bf16, or FP8 E4M3 x E4M3 with DeepSeek-style block
  scales (1x128 per token for the activations, 128x128 for the weights; the
  partial product of every 128-wide K block is scaled in registers and added
  to an fp32 accumulator, "scale promotion", scheduled behind WGMMAs: 128-wide
  tiles alternate two partials per warpgroup, 192-wide tiles keep one and
  the two consumer warpgroups take turns to issue, reading the scales that
  warp 1 staged in shared memory; what the promotion and its scales still
  cost is in "Where the time goes" below); or bf16
  activations x MXFP8 weights (E4M3 + E8M0 per 32 along K) dequantized to
  bf16 in shared memory inside the kernel;
* token layouts: *contiguous* (rows of all experts back to back, ``offsets``
  [E+1] int32 on the GPU) or *masked* (``[E, max_tokens, K]`` with ``counts``
  [E] int32 on the GPU).  Nothing is read back to the host.
* epilogue: plain bf16 store, or SwiGLU (``silu(gate) * up``) when the weight
  rows are interleaved in blocks of ``tile_n // 2`` (see
  ``grouped_gemm.interleave_gate_up``): each output tile then holds the gate
  and the up half of the same channels, so the activation is thread-local.
  An optional per-row weight (the router probability) multiplies the result.

Work decomposition.  Every CTA first builds, in shared memory, the prefix sum
of output tiles per expert (one warp, shuffle scan over the GPU-resident
counts).  Tiles are numbered expert by expert, N-tile-major and M-tile-minor
inside an expert so that CTAs working at the same time share a weight tile in
L2; CTA ``c`` of ``G`` takes tiles ``c, c+G, ...``.  Warp 0 issues TMA loads
for A (the tokens) and B (the weights) into a multi-stage mbarrier pipeline;
with FP8 192-wide tiles warp 1 copies each tile's block scales into shared
memory through a second, two-stage pipeline (``ScaleStaging``); one or two
consumer warpgroups run WGMMA and hand each finished tile to two store warps
through shared memory, so its global stores drain while the consumers run the
next tile's mainloop.

Code: this module holds the configuration, the host side, the schedule, the
TMA producer and the bf16 mainloop; ``grouped_gemm_sm90_scaled`` the FP8
block-scaled and MXFP8 mainloops; ``grouped_gemm_sm90_epilogue`` the epilogue
(registers -> shared memory -> 16-byte stores predicated on each row, so rows
of a tile past its expert are never written; TMA zero-fills K and N beyond the
tensor bounds, so N and token counts need not be multiples of the tile).

Measured on one H200 of a 2x H200 machine (bench/results/grouped_gemm.jsonl at
d53287d0f526, 2026-11-30, GPU 1, 128 experts, Qwen3-235B / Qwen3-30B shapes), each
figure sustained / burst (bench ``--timing``; the GPU holds its 700 W power cap under
sustained load and lowers its SM clock, so long kernels lose 5-15% sustained):
bf16 prefill at 375 tokens per expert 604-672 / 608-709 TFLOP/s, at 2048 633-683 /
717-772 (1.07-1.57x torch._grouped_mm); FP8 block-scaled 849-1031 / 889-1130
(1.03-4.1x torch's rowwise _scaled_grouped_mm); dense GEMMs in the same run: bf16
672 / 784, FP8 (torch._scaled_mm) 1271 / 1431.  GPU 0 of the same call, prefill
only: bf16 615-696 / 617-781, FP8 912-1063 / 912-1161.  Decode (1-64 tokens per
expert) bf16 streams 3.63-4.27 TB/s of weights (1.21-1.67x torch), FP8 takes
0.50-0.58 of bf16's time; decode PTX equals a371ffeef6e4's, where 30B down at 64
tokens streamed 3.70 / 3.71 TB/s: machine-to-machine spread is 2-3%.  An ncu profile
of single launches (d53287d0f526): bf16 30B down at 375 tokens keeps the tensor pipe
74% busy with DRAM at 56% (2.68 TB/s, about the bytes that must move), 30B gate_up
80%, 30B down at 2048 tokens 88%; FP8 54% (30B down) and 67% (235B gate_up).
Re-measured at 8d3ba77539c5 (lines so tagged; they ran the "+h30-epi2" working tree, see
the PYTHONPATH pitfall below; both GPUs of another 2x H200 machine, prefill, sustained /
burst): bf16 375 tokens 613-713 / 637-764, 2048 623-692 / 702-795;
FP8 862-1061 / 864-1152; dense bf16 675-702 / 792-816, FP8 1247-1277 / 1450-1505.
Latest figures (677a70d6fb78+h38-smemscales, scales staged in shared memory, both GPUs of one
2x H200 call, sustained / burst): FP8 at 375 tokens 956-1147 / 961-1221, at 2048 896-1095 /
1040-1238 (>= 1100 in bursts on 6 of 8 shape/token cases, not 30B down); bf16 at 375 638-673 /
638-734; the leaner staging loop adopted after that call moved 30B down at 375 to 960 / 997
burst (see "Adopted since" below).
Re-measured at 95e3dc2333f4 with the third tile bucket (below), both GPUs of one 2x H200
call, prefill at 375 / 2048 tokens, sustained / burst: bf16 623-694 / 638-732 and
641-701 / 726-792 (1.06-1.75x torch._grouped_mm); FP8 910-1072 / 915-1140 and
865-1009 / 1009-1172 (1.04-4.19x torch's rowwise _scaled_grouped_mm); dense bf16
687-690 / 796-804, FP8 1258-1260 / 1467-1481.  bf16 at 375 stays below 650 sustained
in 6 of 8 shape-GPU pairs (623-645); FP8 reaches 1100 only in bursts (1111-1172: 235B
gate_up at 375 and 2048, 235B down and 30B gate_up at 2048).

Where the time goes, FP8 128x192 (fe9548763f2a kernel code, helper 36's calls 1, 3 and 4 on
one 2x H200 machine, burst at 1980 MHz, 375 tokens per expert; scratch copies of the kernel
with switches, results wrong by design; repeated variants agree within 0.5 points).
Fraction of the FP8 tensor peak (8192 FLOP/clk/SM), Qwen3-235B gate_up / Qwen3-30B down:

* full kernel 52.8 / 42.1%; plain accumulation (bf16's pipelined mainloop: no promotion, no
  scale loads) 63.6 / 48.4%; plain plus 96 FFMAs per K block per thread on other registers,
  independent of the WGMMAs (a promotion's arithmetic and nothing else) 54.2 / 42.4%;
  the full kernel promoting only the last K block (loads, turns, wait_group(0) kept)
  60.4 / 46.2%; constant scales instead of the scale loads 56.6 / 46.5%;
* without TMA and pipeline waits (the WGMMAs read stale shared memory): full 70.9 / 50.8%,
  plain 84.5 / 66.8%, plain + FFMAs 73.3 / 56.6%; bf16 128x192 and 128x256 86 / 76% of
  the bf16 peak; plain FP8 with 64x128, 64x256 or two 64x96 WGMMAs per warpgroup within 1.5
  points of 64x192 on 235B gate_up (on 30B down, K = 768, 64x128 and 2 x 64x96 lost 3-8).

So (1) the FP8 WGMMA runs at the same fraction of its peak as bf16 (84.5 vs 86% without
memory): the instruction is not the limit.  (2) On 235B gate_up with memory the full
kernel's 10.8 points below plain split into the scale loads 3.8 (constant scales: 56.6%),
the promotion FFMAs 3.8 (promoting only the last block, which also skips the other blocks'
scale products: 60.4%) and the one-partial wait_group(0) / turn structure 3.2 (plain:
63.6%); 30B down alike (4.4, -0.3, 2.2 of 6.3).  Without memory the scale loads dominate:
constant scales +10.5 points on both shapes, promoting only the last block +9.2 (235B) and
+5.6 (30B).  What costs is the loads themselves, not their latency (call 4, same GPU, 375
tokens, burst / sustained): constant scales +6.7..+10.9% on all four shapes (1120 -> 1195
TFLOP/s 235B gate_up, 1020 -> 1101 235B down, 1037 -> 1126 30B gate_up, 904 -> 1002 30B
down, burst); but loading a block's scales after its WGMMAs are issued and the turn passed
(in HEAD the products are multiplied between the block's third and fourth WGMMA, so the
fourth WGMMA and the pass wait for the loads) ran -1.3..-0.6% / -7.1..-0.3%, and loading the
next block's a block ahead (91f4cc30e91f's way) -2.7..-1.3% / -6.6..-1.0%.  Per K block each
consumer thread issues 5 scalar loads (2 activation scales, 8 rows per warp; 3 warp-uniform
weight scales) and their address arithmetic; a plausible cost is their passage through L1,
which shares its data path with shared memory (the TMA writes, the WGMMAs' operand reads).
FFMAs beside WGMMAs are not free either: 96 per block on unrelated registers added to the
plain mainloop (both warpgroups issuing at once) cost 9.4 points with memory and 11.2
without, although ptxas
already alternates the yield and reuse bits of consecutive promotion FFMAs (their control
words differ by 0x0800200000000000, the pattern DeepGEMM's SASS pass once set by hand; SASS
as compiled here with CuTeDSL's CUDA 12 libraries, the device's CUDA 13 build was not
disassembled), and their count per FLOP is fixed by the format (one per output element per
128-wide K block, whatever the tile).  The "halves" schedule below, which keeps a WGMMA
batch in flight through every promotion, gained nothing.  (3) The memory path costs
20-25% in both dtypes: plain FP8 at 63.6% moves 9.1 TB/s of operand tiles from L2 to the
SMs, bf16 128x192 9.5 and 128x256 8.6 TB/s (67.7-67.8% of the bf16 peak), and on half the
SMs (66 CTAs) plain FP8 128x256 ran at 78.3%: a limit shared by the SMs (L2 and the path
to them) near 9 TB/s.  An earlier ablation (8d3ba77539c5: "without promotion and scales,
and with constant scales, within 1% of the full kernel") never ran its variants: its
scratch copy was put first on PYTHONPATH and run with ``python3 -m``, which puts the
working directory, the checkout, first on sys.path, so every arm ran the checkout's
kernel (checked here: a scratch ``kernels`` package on PYTHONPATH is shadowed under
``-m``; ``PYTHONSAFEPATH=1``, or a script path instead of ``-m``, avoids it).  ncu's
SASS-level stall samples at 8d3ba77539c5 (30B down, 375 tokens): bf16 consumer warps wait
mostly on the stage-full mbarrier (41% of all warp samples), FP8 consumers on their own
WGMMAs (wait_group, 17%) with the data already in shared memory.
The same kernels on half the SMs (a0f3c0311772, burst, 375 tokens, 128x192 tiles for both
dtypes): per SM bf16 ran 22-24% faster, FP8 13-15%; FP8 then reached ~60% of its per-SM
peak, bf16 75-84%: the difference is (2).
Adopted since (vector scale loads, ``scale_vector``): a row's activation and weight scales of
consecutive K blocks are contiguous, so when K/128 is a multiple of 4 one 16-byte load
fetches 4 blocks' worth (the launch promises the scale pointers that alignment) and the K
loop steps 4 blocks with the inner 4 unrolled.  Against the single loads, same call, both
GPUs in opposite orders (c2296fb6431c+vec4, burst): 235B gate_up +3.4/+4.0% at 375 tokens
(1183/1196 TFLOP/s), +7.5/+5.2% at 2048 (1216/1207); 235B down +1.1/+1.3%, +2.4/+2.8%; 30B
gate_up +2.1/+1.7%, +3.2/+4.6% (1210/1225 at 2048); sustained mostly alike but for
power-capped swings of +-10% in both directions.  8-byte loads of 2 blocks (30B down, K = 768:
6 blocks) had run 4% slower than single loads (helper 36's call, c2296fb6431c+h36-vec), so
such K keeps the single loads (30B down level: 915/923 against 914/921).  So about half the
constant-scale bound.
Adopted since (scales staged in shared memory, ``ScaleStaging``, helper 38): warp 1 of the
producer warpgroup, idle before, copies each tile's scales into shared memory by ``cp.async``
(the tile's 128 activation-scale rows and its 3 weight-scale rows, a chunk of up to 12 K blocks
per stage, 2 stages; 16-byte copies of 4 blocks when K/128 is a multiple of 4, else 4-byte
ones), each lane's ``cp.async.mbarrier.arrive.noinc`` completing the stage; the consumers read
them with ``ld.shared`` (per 4 blocks, or per block, 2 activation rows + 3 weight rows; a row
padded so a warp's 8 rows fall in distinct banks).  The global loads (each activation scale
fetched by 4 lanes, each weight scale by all 256 consumer threads) become one copy per scale
row and chunk, off the consumer warps.  Against the 16-byte global loads,
same call on both GPUs of one 2x H200, opposite orders, each arm run from its own tree
(677a70d6fb78+h38-smemscales against 677a70d6fb78), burst / sustained, GPU 0 / GPU 1, 375
tokens per expert: 235B gate_up +0.8 / +1.2%, +1.5 / +2.5% (1188, 1221 TFLOP/s burst); 235B
down +5.5 / +16.4% (the old arm's sustained ran at 1825 MHz), +5.6 / +8.2% (1117, 1145);
30B gate_up +3.4 / +2.7%, +3.6 / +3.5% (1124, 1153; sustained 1112, 1147); 30B down +5.3 /
+5.6%, +5.9 / +6.2% (961, 984; both arms at 1968-1980 MHz); at 2048 tokens 235B gate_up -1.6
/ -0.1%, -2.4 / 0.0% (power-capped bursts at 1632-1752 MHz), 235B down +3.0 / +3.4%, +4.7 /
+2.3%, 30B gate_up +0.2 / +1.6%, +0.4 / +0.3%, 30B down +2.9 / +1.7%, +2.9 / -1.8%.  GPU
tests of the new tree 44 + 19 passed (1 skipped).  What is left of the scales (helper 38's
call 2, scratch switches on 25e4e52, same call, burst, 375 tokens, GPU 0 / GPU 1): made-up
scales with the staging kept (no shared-memory reads) +1.6 / +1.2% on 30B down, +0.9% on 235B
gate_up (GPU 0), +2.1% on 30B gate_up (GPU 1); made-up scales without any staging (warp 1
idle, no chunk waits: the constant-scale bound) +5.5 / +5.2%, +7.3%, +6.3% (992 / 1026, 1236,
1208 TFLOP/s against 941 / 975, 1152, 1137).  So the reads cost 1-2% and the staging itself
4-6%: warp 1's copy loop (~24 SASS instructions per copy, on the scheduler it shares with one
warp of each consumer warpgroup, whose WGMMAs wait for it) or the consumers' chunk waits; not
measured apart.  Adopted since (helper 38's call 3, c9ae80d + switch, same call, both GPUs in
opposite orders, burst, 375 tokens, each variant twice within 0.2%): the copy loop with a
fixed (row, piece) slot per lane and its passes unrolled, ~8 SASS instructions per copy
instead of ~24: 30B down +2.0 / +2.5% (960 / 997 TFLOP/s), 30B gate_up +0.6% (1144, GPU 1),
235B gate_up -0.2% (1150, GPU 0); GPU tests (FP8) with it 25 passed; not measured sustained,
at 2048 tokens or on 235B down.  The no-staging bound in that call: 993 / 1027, 1207, 1237.
Tried and dropped: skipping the accumulator's zeroing (the tile's first
promotion writes ``acc = part * s``, a run-time branch between two promotion copies): -12%
on 30B down (826 / 857 against 941 / 975 burst, alike sustained), -0.6..-1.9% elsewhere
(its GPU tests passed).
Tried and dropped (helper 45, 9c102318f73b+h45-overlap, kernel as 17199ce's): the next tile's
first K block issued before the epilogue, each block being wait -> promote -> issue the next,
so that the epilogue hand-off, the tile switch and the next chunk's scale wait run under
WGMMAs (predicted +2..+6% on 30B down from a modelled idle of 100-250 cycles per tile
boundary, less at larger K).  Same call on both GPUs of one 2x H200, opposite orders, each arm
from its own tree, each FP8 case twice per arm (repeats within 0.5% burst), GPU 0 / GPU 1,
burst: 30B down at 375 tokens -3.3 / -3.1% (952 / 940 against 984 / 970 TFLOP/s), at 2048
+0.3 / +0.7% (1060 / 1047); 30B gate_up -7.1 / -6.8% (375), -6.3 / -6.0% (2048); 235B down
-3.6 / -3.3%, -4.4 / -4.2%; 235B gate_up -6.0 / -5.3%, -8.1 / -6.5%; sustained -8..+2%
(power-capped).  bf16 (PTX identical in both arms) moved -0.9..+0.4% burst but for one
clock-shifted case (+3.5% at 1704 against 1857 MHz) and -5.7..+8.8% sustained: the spread
of one kernel.  GPU tests of that tree 44 + 19 passed (1 skipped).  The SASS shows why it lost at every K
rather than gained at tile boundaries: (1) with 4-block scale vectors (K/128 a multiple of 4)
the partial, live through the epilogue, made ptxas spill 36-60 bytes, with STL / LDL inside
the K loop; (2) on 30B down (no spills) ptxas put the scale products' FMULs after the WGMMA
wait and the stage release after 13 of the 96 promotion FFMAs, where 17199ce's SASS has the FMULs
between the block's WGMMAs and the release first.  Each warpgroup has one batch in flight, so
the wait -> promote -> issue chain of every block sets the pace and tens of cycles on it cost
percent; any tile-boundary gain is smaller than that.  Two reworks compiled without spills
(scalar scale reads per block; the next block's scales read before its issue) but ptxas still
placed the release after 13-50 FFMAs; not measured.
Bounds of 30B down measured after (helper 45's call 2, burst at 1980 MHz, GPU 0 / GPU 1;
scratch kernels: helper 38's ``full`` with the lean loop = 17199ce's kernel and ``nostage`` =
made-up scales without staging, helper 36's ``plain`` = no promotion and no scales, bf16's
mainloop): at 375 tokens full 978 / 1001, nostage 1011 / 1033, plain 1042 / 1060 TFLOP/s; at
2048 full 1053 / 1077, nostage 1114 / 1140, plain 1184 / 1216.  So at 375 tokens 1100 is out
of reach of this tile structure and memory path even with no scale work at all (plain 4-6%
short): 1100 TFLOP/s would move the 434 MB that must move (weights 201, bf16 output 196,
activations 37) at 3.17 TB/s, 75% of the 4.24 TB/s copy measured in the same machine's call,
while the SMs also pull 1.04 GB of operand tiles from L2 (245 KB per 128x192 tile, 4224
tiles: 7.6 TB/s at 1100, near the ~9 TB/s L2-to-SM limit found above).  At 2048 tokens the
scales' staging and reads cost 5.8% on both GPUs (nostage against full) and 1100 is 2.1-4.5% above the
full kernel: within what a cheaper scale path could recover, not excluded by these bounds.
Tried since (helper 50, b055d136ff6e, both GPUs of one 2x H200 per call, opposite orders, each
arm from its own tree, burst, GPU 0 / GPU 1): (a) scales staged by TMA, one elected lane of
warp 1 per chunk issuing a box of the tile's activation-scale rows (rows padded to 4 blocks by
the act quantizer, a [T, K/128] view of 16-byte rows) and a 1-D box per weight-scale quarter
row, completing on a ``PipelineTmaAsync`` stage; the copy loop's ~8 instructions per copy gone.
Slower everywhere (call 1, 3 reps per arm): 235B gate_up -1.1 / -0.6% at 375 tokens, 0.0 /
-1.3% at 2048; 235B down -0.9 / -1.1%, -1.6 / -2.1%; 30B gate_up -0.4 / -0.2%, +0.2 / +0.1%;
30B down (call 2, 2 reps) -2.4 / -2.2% (945 / 972 against 968 / 994 TFLOP/s), -0.6 / -0.8%
(1034 / 1062 against 1040 / 1071): removing warp 1's copy instructions this way did not pay.
A 1-D box must start 16-byte aligned: weight-scale rows of 6 floats (30B down) took an
illegal instruction until the boxes started at the 16-byte boundary below, 4 floats longer.
(b) the same padded activation-scale rows with HEAD's ``cp.async`` staging, 16-byte copies (8
passes a tile instead of 26 passes of 4-byte copies on 30B down) and reads of 2 blocks: 30B down
+0.4 / +0.5% at 375 tokens (973 / 999), +1.4 / +1.4% at 2048 (1055 / 1086); sustained +0.2 /
+0.6%, -0.8 / -2.4% (the old arm's own sustained repeats spread 902-982 and 908-1062); PTX
identical to HEAD on the other three shapes; GPU tests of both trees passed (62 each).  Not
adopted: short of 1100 at 2048 tokens on both GPUs, for an activation-scale layout change (HEAD's
kernel there ran 1066-1068 / 1099-1103 in call 1, 1039-1040 / 1070-1071 in call 2: machine
starts differ by up to 3%).  What
is left between the staged kernel and the no-staging bound (3-6%) is mostly not the copy loop.
Leads left: more scale stages; keeping the
per-block chain short in the SASS (release first, products under the WGMMAs).  For 30B down
(K = 768, 6 blocks a tile) per-tile fixed costs (the epilogue hand-off, the tile switch) weigh 5x
more than at K = 4096; still not measured apart (the A/B above moved the chain too).  Then the
memory path (20-25%): fewer L2 bytes per FLOP, i.e. TMA multicast in CTA pairs (tried for other reasons, below;
the tile cannot grow: acc + partial fill the registers at 128x192).  DeepGEMM's way of bringing
the activation scales (TMA per pipeline stage, which needs them MN-major, a new act-quant
layout and API) is not needed for the loads: the idle warp already stages them without
changing the layout.

Tried and not adopted as defaults, same GPU, same call (d53287d0f526, sustained /
burst against 128x256): at 375 tokens per expert 128x192 bf16 tiles were +2.3 / +0.9%
(235B down), +4.4 / +3.5% (30B gate_up), +3.1 / +3.2% (30B down) and -0.8 / -0.4%
(235B gate_up), 128x128 +8.4 / +3.0% on 30B gate_up and +1.6% on 30B down, -1..-6%
elsewhere; at 2048 tokens both were 2-9% slower on every shape.  FP8 128x128
two-partial tiles against 128x192: 192 ahead or level on 7 of 8 prefill shapes.
Adopted since as a third tile bucket for bf16 prefill of small experts (see
``grouped_gemm_launch.choose_config``): 128x192 against 128x256 forced in the same
call on both GPUs (95e3dc2333f4, opposite orders, sustained / burst): Qwen3-30B shapes
at 375 and 512 tokens +1.5..+10.5 / +1.5..+4.0% on all 8 measurements, Qwen3-235B at
375 / 512 -5.8..+0.2 / -0.2..+1.7% (sustained at 1440-1980 MHz, 30B at 1820-1980),
every shape at 2048 -1.1..-7.5 / -0.9..-8.6%; the call before (a0f3c0311772, logs
only, its result lines did not come back) also had 768, 1024 and 1536 tokens: -6..+1%
sustained and -6..+1% burst by shape, but for two sustained outliers on 30B down (+4.9%
at 768 on one GPU, +7.3% at 1024 on the other).  Hence the rule: N * K <= 4 Mi and at
most 512 tokens per expert.

FP8 toward 1100 sustained, ideas weighed against this kernel (not built):
a BLOCK_N per shape to cut wave quantization over 132 SMs (DeepGEMM picks from
112..256): by count of padded rows, columns and the last wave, 128x192 does
0.947-0.997 useful work at 375-2048 tokens; the best width in 112..256 per shape does
0.967-0.974 at 375 and 0.996-0.999 at 2048, at most 3.2% more, always at 128 or 256:
256 does not fit (next), 128 measured level or slower (above).
128x256 FP8 tiles need 128 accumulator + 128 partial-product registers per consumer
thread, over the 232 this kernel gives them; DeepGEMM's 256-row tiles (two 64-row
waves per warpgroup, one partial) move 10% fewer bytes per FLOP from L2 but compute
512 rows for 375 tokens, and its promotion schedule is the plain one dropped below.
The order of tiles already has the CTAs working at one time share each weight tile
in L2 (DRAM moves about the bytes that must move, see the ncu figures).  What the
promotion, the scale loads and the operand path cost is measured in "Where the time
goes" above, with the leads that follow from it.
Tried and dropped: FP8 192-wide tiles as two 96-column halves with a partial each (64x96
WGMMAs, 96 + 48 + 48 registers; each warpgroup promotes one half while the other half's
batch runs, no turns; K loop unrolled, C7514 otherwise; fe9548763f2a+h36-halves).  Through
the scratch script on GPU 0 of helper 36's call 2, against this kernel through the same
script on GPU 0 of calls 1, 3 and 4 (separate machine starts), burst, 375 tokens: 30B down
912 against 900-908 TFLOP/s, 235B gate_up 1046 against 1120 (-7%); without memory 51.4%
against 50.8% and 45.3% against 70.9% (the unrolled 32-block loop, ~5000 instructions,
probably outgrows the instruction cache); compiles in 9-20 s instead of 1-2 s.  That
call's bench A/B compared the halves with themselves (the PYTHONPATH pitfall above) and is
void; its result lines did not come back.  For FP8, one partial per warpgroup without
turns (DeepGEMM's plain schedule; the warpgroups' promotions coincide, 6-17% slower than two
partials, d2c25f900d65), scales loaded a block ahead (91f4cc30e91f); bf16
128x192 tiles (4 stages instead of 3; 0-7% slower than 128x256) and 64x256
decode tiles (within 1%), d2c25f900d65.  CTA pairs sharing one operand tile by
TMA multicast.  Pairs along M sharing the weight tile lost 20-27% at 375 tokens
per expert (an expert's 3 M tiles became 2 pairs; 5e6727614d60); pairs along N
sharing the token tile were within -6%..+10% of single CTAs per shape in the
same call (79cf9e99e7e7, ``--cluster-n 2``), no consistent gain.  The cluster
launch attribute alone, with one CTA per cluster, had cost the 128x128 bf16
tiles (the fused SwiGLU GEMM) about a quarter of their speed: 424 TFLOP/s at
06558783ead2, 576 at 79cf9e99e7e7 without it (235B gate_up, 375 tokens).  One more
pipeline stage (bf16 128x256: 4 instead of 3; FP8 128x192: 5 instead of 4) by
handing each output tile to the store warps in two halves through a half-size
buffer (bf16: the second half written during the next tile's first stage; store
warps serving each warpgroup's rows on their own), against this kernel on both GPUs
of one call (8d3ba77539c5, "+h30-epi2" in the results): burst within 1% on 14 of 16
prefill cases per GPU (235B down 2048 bf16 +1.3 / +3.5%), sustained mostly within
1.5% but 30B gate_up 375 bf16 -7 / -9% -- but both arms of that A/B ran the "+h30-epi2"
tree (its "old" arm was a scratch copy on PYTHONPATH under ``python3 -m``, the pitfall
above; its 36 result lines tagged plain 8d3ba77539c5 measured "+h30-epi2" too), so these
are the spread of one kernel and whether one more stage helps is open.  The comparison
within that tree (a switch) stands: with the second half written at once, bf16 lost 1-6%.
bf16 192x256 tiles computed as their transpose (weight rows on the MMA's M side, two
64x192 WGMMAs per warpgroup, 22% fewer operand bytes per FLOP than 128x256, transposed
stmatrix, the output in two halves; correct on GPU, 77c6be1bd7e5+h30-swap in the
results), same GPU and call as 128x256, sustained / burst: at 375 tokens +0.3 / +1.6%
(235B gate_up), +0.3 / +1.5% (235B down), +3.9 / +4.4% (30B gate_up), +2.5 / +3.9%
(30B down); at 2048 -1.6..-6.1 / -1.8..-7.0%.  About what the plain 128x192 tiles
gave, so fewer L2 bytes per FLOP alone do not lift these shapes either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum

from kernels.grouped_gemm_sm90_epilogue import EPI_N, STORE_WARPS, Epilogue
from kernels.grouped_gemm_sm90_scaled import MX_B_BUFFERS, MX_BLOCK, SCALE_BLOCK, ScaledMainloops

SWIGLU_BLOCK = 64  # gate/up rows are interleaved in blocks of this many rows
SMEM_CAPACITY = 232448  # bytes of shared memory per CTA on sm_90 (227 KiB)
SCALE_WARP = 1  # the producer warpgroup's warp that stages FP8 scales (0 issues TMA, STORE_WARPS store)


@dataclass(frozen=True)
class GroupedGemmConfig:
    """Everything that selects one compiled kernel (the cache key)."""

    num_experts: int
    n: int  # output columns (weight rows); for SwiGLU the gate+up width 2I
    k: int
    masked: bool  # masked [E, max_tokens, K] layout, else contiguous
    fp8: bool  # E4M3 operands with 1x128 / 128x128 fp32 block scales
    tile_m: int  # 64 (one consumer warpgroup) or 128 (two)
    tile_n: int  # 64 / 128 / 192 / 256 (bf16), 128 / 192 (FP8), 128 (MXFP8, SwiGLU)
    swiglu: bool = False  # epilogue silu(gate) * up over interleaved weight rows
    row_weights: bool = False  # multiply output row r by weights[r]
    mxfp8: bool = False  # bf16 activations x MXFP8 weights (E4M3 + E8M0 per 32 along K), bf16 math
    num_sms: int = 132  # persistent CTAs launched

    def validate(self) -> None:
        elem_bytes = 1 if self.fp8 else 2
        if self.tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {self.tile_m}")
        if (self.tile_n not in (64, 128, 192, 256) or (self.fp8 and self.tile_n not in (128, 192))
                or (self.mxfp8 and self.tile_n != 128)):
            raise ValueError(f"tile_n {self.tile_n} unsupported (fp8 128/192, mxfp8 128; bf16 64/128/192/256)")
        if self.fp8 and self.mxfp8:
            raise ValueError("fp8 (block-scaled E4M3 x E4M3) and mxfp8 (bf16 x MXFP8 weights) exclude each other")
        if (self.k * elem_bytes) % 16 or (self.mxfp8 and self.k % 16):
            raise ValueError(f"K={self.k}: rows must be 16-byte aligned for TMA ({16 // elem_bytes} elements; "
                             "16 for MXFP8 weights)")
        if self.swiglu and (self.tile_n != 2 * SWIGLU_BLOCK or self.n % self.tile_n):
            raise ValueError(
                f"SwiGLU needs tile_n={2 * SWIGLU_BLOCK} and N={self.n} a multiple of it (gate/up interleaved in {SWIGLU_BLOCK}-row blocks)"
            )
        if self.num_experts < 1:
            raise ValueError("num_experts must be >= 1")

    @property
    def out_n(self) -> int:
        return self.n // 2 if self.swiglu else self.n


def scale_vector(cfg: GroupedGemmConfig) -> int:
    """How many consecutive K blocks' scales one copy moves (FP8 192-wide tiles, see ``ScaleStaging``).

    A row of the activation scales and of the weight scales holds its K blocks
    contiguously, so 4 of them are one 16-byte copy when the number of K blocks
    is a multiple of 4: the scale pointers are then promised that alignment.
    Other configurations move one block's scales at a time.
    """
    if not cfg.fp8 or cfg.tile_n != 192:
        return 1
    return 4 if math.ceil(cfg.k / SCALE_BLOCK) % 4 == 0 else 1


@dataclass(frozen=True)
class ScaleStaging:
    """Shared-memory staging of an FP8 192-wide tile's scales (``_stage_scales``, ``_fp8_one_partial``).

    Each stage holds ``chunk`` consecutive K blocks' scales of one output tile:
    ``[tile_m rows][row_stride]`` activation scales (row-major like the
    tensor, a row padded so that the 8 rows one warp reads fall in distinct
    banks) and ``[quarters][chunk]`` weight scales (one row per 64-column
    quarter of the tile).  ``chunk`` divides the K blocks (at most
    ``MAX_CHUNK``, a multiple of the copy width ``vec``), so a tile has whole
    chunks only.
    """

    vec: int  # K blocks per copy and per shared-memory read (scale_vector)
    chunk: int  # K blocks per stage
    row_stride: int  # floats between activation-scale rows of a stage
    rows: int  # tile_m
    quarters: int  # tile_n // 64

    STAGES = 2
    MAX_CHUNK = 12

    @staticmethod
    def of(cfg: GroupedGemmConfig) -> ScaleStaging | None:
        """The staging of ``cfg``'s kernel, or None where the consumers load their scales from global memory."""
        if not cfg.fp8 or cfg.tile_n != 192:
            return None
        vec, blocks = scale_vector(cfg), math.ceil(cfg.k / SCALE_BLOCK)
        chunk = max(c for c in range(vec, ScaleStaging.MAX_CHUNK + 1, vec) if blocks % c == 0)
        # A warp reads 8 rows at once, `vec` floats each: rows whose words (vec 1) or
        # 16-byte groups (vec 4) are an odd number apart never share a bank.
        unit = chunk // vec
        row_stride = chunk + (vec if unit % 2 == 0 else 0)
        return ScaleStaging(vec=vec, chunk=chunk, row_stride=row_stride, rows=cfg.tile_m, quarters=cfg.tile_n // 64)

    @property
    def a_floats(self) -> int:
        return self.STAGES * self.rows * self.row_stride

    @property
    def b_floats(self) -> int:
        return self.STAGES * self.quarters * self.chunk

    @property
    def smem_bytes(self) -> int:
        """Both buffers, each 16-byte aligned."""
        return 4 * (self.a_floats + self.b_floats) + 32


class GroupedGemmSm90(ScaledMainloops, Epilogue):
    """CuTeDSL kernel object for one :class:`GroupedGemmConfig`.

    Call (through ``cute.compile``) with raw device pointers:
    ``(a, b, c, groups, sfa, sfb, row_w, rows, stream)`` where ``rows`` is the
    number of token rows of ``a`` (contiguous) or ``max_tokens`` (masked).
    Pointers that a configuration does not use (scales without FP8, row
    weights without ``row_weights``) are never dereferenced.
    """

    def __init__(self, cfg: GroupedGemmConfig):
        cfg.validate()
        self.cfg = cfg
        # ab_dtype: the MMA operand type (A's type); MXFP8 weights arrive as E4M3 and are
        # dequantized to bf16 in shared memory before the MMA reads them.
        self.ab_dtype = cutlass.Float8E4M3FN if cfg.fp8 else cutlass.BFloat16
        self.b_load_dtype = cutlass.Float8E4M3FN if (cfg.fp8 or cfg.mxfp8) else cutlass.BFloat16
        self.c_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        self.num_consumer_wg = cfg.tile_m // 64
        self.threads = 128 * (1 + self.num_consumer_wg)
        # K per pipeline stage: 64 bf16 (128 B rows, SW128) or 128 fp8 (one scale block).
        self.tile_k = SCALE_BLOCK if cfg.fp8 else 64
        self.k_tiles = math.ceil(cfg.k / self.tile_k)
        self.n_tiles = math.ceil(cfg.n / cfg.tile_n)
        self.scale_k_blocks = math.ceil(cfg.k / SCALE_BLOCK)
        self.scale_vec = scale_vector(cfg)
        # Weight-scale rows: 128-row blocks of N, or with SwiGLU (interleaved 64-row
        # gate/up halves) one per half tile; see interleave_gate_up.
        self.scale_n_blocks = 2 * self.n_tiles if cfg.swiglu else math.ceil(cfg.n / SCALE_BLOCK)
        stage_bytes = (cfg.tile_m * self.ab_dtype.width + cfg.tile_n * self.b_load_dtype.width) * self.tile_k // 8
        # FP8 192-wide tiles: the scales come through shared memory (see ScaleStaging)
        self.staging = ScaleStaging.of(cfg)
        scale_bytes = self.staging.smem_bytes if self.staging else 0
        # mbarriers (at most 8 stages + the scale stages) + schedule, padded to the 1024-byte alignment of the tiles
        reserved = -(-(16 * (8 + ScaleStaging.STAGES) + 12 * (cfg.num_experts + 1)) // 1024) * 1024
        self.out_cols = cfg.tile_n // 2 if cfg.swiglu else cfg.tile_n  # output columns per tile
        self.out_chunks = self.out_cols // EPI_N
        epi_bytes = cfg.tile_m * self.out_cols * 2  # one bf16 output tile, drained by the store warps
        mx_bytes = MX_B_BUFFERS * cfg.tile_n * self.tile_k * 2 if cfg.mxfp8 else 0
        self.stages = min(8, (SMEM_CAPACITY - reserved - epi_bytes - mx_bytes - scale_bytes) // stage_bytes)
        # Output elements per 16-byte global store in the epilogue (fewer when rows are not 16-byte aligned).
        self.store_vec = math.gcd(8, cfg.out_n)
        # FP8 192-wide tiles: one partial, the two consumer warpgroups take turns (see _fp8_one_partial).
        self.fp8_turns = cfg.fp8 and cfg.tile_n != 128 and self.num_consumer_wg == 2
        # bf16 with two consumer warpgroups: they take turns to issue each stage (see _mainloop).
        self.bf16_turns = not cfg.fp8 and not cfg.mxfp8 and self.num_consumer_wg == 2
        self.turns = self.fp8_turns or self.bf16_turns
        self.producer_regs = 40
        self.consumer_regs = 232 if self.num_consumer_wg == 2 else 240

    def _make_tiled_mma(self) -> cute.TiledMma:
        """WGMMA tiling: one 64 x tile_n atom per consumer warpgroup, both operands K-major in smem."""
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.num_consumer_wg, 1, 1),
            tiler_mn=(64, self.cfg.tile_n),
        )

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        groups_ptr: cute.Pointer,
        sfa_ptr: cute.Pointer,
        sfb_ptr: cute.Pointer,
        row_w_ptr: cute.Pointer,
        rows: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        E, N, K = cfg.num_experts, cfg.n, cfg.k
        batches = E if cutlass.const_expr(cfg.masked) else 1
        rows64 = cutlass.Int64(rows)
        # A: (rows, K, batch) K-major; masked layout batches over experts.
        mA = cute.make_tensor(a_ptr, cute.make_layout((rows, K, batches), stride=(K, 1, rows64 * K)))
        mB = cute.make_tensor(b_ptr, cute.make_layout((N, K, E), stride=(K, 1, N * K)))
        out_n = cfg.out_n
        mC = cute.make_tensor(c_ptr, cute.make_layout((rows, out_n, batches), stride=(out_n, 1, rows64 * out_n)))
        n_groups = E + 1 if cutlass.const_expr(not cfg.masked) else E
        mGroups = cute.make_tensor(groups_ptr, cute.make_layout(n_groups))
        # Activation scales (rows, K/128, batch); weight scales (N/128, K/128, E).
        skb = self.scale_k_blocks
        sfa_batch_stride = cute.assume(rows64 * skb, divby=self.scale_vec)
        mSFA = cute.make_tensor(sfa_ptr, cute.make_layout((rows, skb, batches), stride=(skb, 1, sfa_batch_stride)))
        if cutlass.const_expr(cfg.mxfp8):
            # E8M0 weight scales (N, K/32, E), one byte each.
            mxk = math.ceil(K / MX_BLOCK)
            mSFB = cute.make_tensor(sfb_ptr, cute.make_layout((N, mxk, E), stride=(mxk, 1, N * mxk)))
        else:
            snb = self.scale_n_blocks
            mSFB = cute.make_tensor(sfb_ptr, cute.make_layout((snb, skb, E), stride=(skb, 1, snb * skb)))
        mRowW = cute.make_tensor(row_w_ptr, cute.make_layout((rows, batches), stride=(1, rows64)))

        self.tiled_mma = self._make_tiled_mma()
        staging = self.staging
        tile_mnk = (cfg.tile_m, cfg.tile_n, self.tile_k)
        self.a_smem_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_mnk, self.ab_dtype, self.stages)
        self.b_smem_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, tile_mnk, self.b_load_dtype, self.stages
        )
        # MXFP8: the MMA reads B from these bf16 buffers (otherwise straight from the TMA stages).
        self.b_mma_smem_layout = (
            sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_mnk, self.ab_dtype, MX_B_BUFFERS)
            if cfg.mxfp8 else self.b_smem_layout
        )
        self.epi_smem_layout = sm90_utils.make_smem_layout_epi(
            self.c_dtype, LayoutEnum.ROW_MAJOR, (cfg.tile_m, EPI_N), self.out_chunks
        )
        tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            mA,
            cute.slice_(self.a_smem_layout, (None, None, 0)),
            (cfg.tile_m, self.tile_k),
        )
        tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            mB,
            cute.slice_(self.b_smem_layout, (None, None, 0)),
            (cfg.tile_n, self.tile_k),
        )

        @cute.struct
        class SharedStorage:
            pipeline_mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            # tile_begin[e] = first output tile of expert e; tile_begin[E] = total
            tile_begin: cute.struct.MemRange[cutlass.Int32, E + 1]
            row_start: cute.struct.MemRange[cutlass.Int32, E]
            row_count: cute.struct.MemRange[cutlass.Int32, E]
            sA: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.a_smem_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_load_dtype, cute.cosize(self.b_smem_layout)], 1024]
            sEpi: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(self.epi_smem_layout)], 1024]
            # MXFP8: the dequantized bf16 weight tiles (otherwise one unaligned byte, outside the stage budget)
            sBmx: (
                cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(self.b_mma_smem_layout)], 1024]
                if cfg.mxfp8 else cute.struct.MemRange[self.ab_dtype, 1]
            )
            # FP8 192-wide tiles: the staged scales (see ScaleStaging; otherwise one float each)
            scale_mbar: cute.struct.MemRange[cutlass.Int64, ScaleStaging.STAGES * 2]
            sSA: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, staging.a_floats if staging else 1], 16]
            sSB: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, staging.b_floats if staging else 1], 16]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_atom_a, tma_a, tma_atom_b, tma_b, mC, mGroups, mSFA, mSFB, mRowW, rows, self.tiled_mma,
            self.a_smem_layout, self.b_smem_layout, self.b_mma_smem_layout, self.epi_smem_layout,
        ).launch(
            grid=[cfg.num_sms, 1, 1],
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mGroups: cute.Tensor,
        mSFA: cute.Tensor,
        mSFB: cute.Tensor,
        mRowW: cute.Tensor,
        rows: cutlass.Int32,
        tiled_mma: cute.TiledMma,
        a_smem_layout: cute.ComposedLayout,
        b_smem_layout: cute.ComposedLayout,
        b_mma_smem_layout: cute.ComposedLayout,
        epi_smem_layout: cute.ComposedLayout,
    ):
        cfg = self.cfg
        E = cfg.num_experts
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        s_tile_begin = storage.tile_begin.get_tensor(cute.make_layout(E + 1))
        s_row_start = storage.row_start.get_tensor(cute.make_layout(E))
        s_row_count = storage.row_count.get_tensor(cute.make_layout(E))

        if warp_idx == 0:
            self._build_schedule(mGroups, rows, s_tile_begin, s_row_start, s_row_count)

        tma_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(a_smem_layout, (None, None, 0))) + cute.size_in_bytes(
            self.b_load_dtype, cute.slice_(b_smem_layout, (None, None, 0))
        )
        # A stage is free once every consumer warp has released it (one arrive per warp).
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.pipeline_mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_consumer_wg),
            tx_count=tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        sA = storage.sA.get_tensor(a_smem_layout.outer, swizzle=a_smem_layout.inner)
        sB = storage.sB.get_tensor(b_smem_layout.outer, swizzle=b_smem_layout.inner)
        sEpi = storage.sEpi.get_tensor(epi_smem_layout.outer, swizzle=epi_smem_layout.inner)
        sBmma = sB
        if cutlass.const_expr(cfg.mxfp8):
            sBmma = storage.sBmx.get_tensor(b_mma_smem_layout.outer, swizzle=b_mma_smem_layout.inner)
        # FP8 192-wide tiles: warp 1 stages each tile's scales in shared memory, a chunk of K blocks per stage.
        scales, sSA, sSB = None, None, None
        st = self.staging
        if cutlass.const_expr(st is not None):
            scales = pipeline.PipelineCpAsync.create(
                barrier_storage=storage.scale_mbar.data_ptr(),
                num_stages=st.STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),  # every lane's copies
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.num_consumer_wg),  # a lane per warp
                defer_sync=True,
            )
            sSA = storage.sSA.get_tensor(cute.make_layout((st.rows, st.row_stride, st.STAGES),
                                                          stride=(st.row_stride, 1, st.rows * st.row_stride)))
            sSB = storage.sSB.get_tensor(cute.make_layout((st.quarters, st.chunk, st.STAGES),
                                                          stride=(st.chunk, 1, st.quarters * st.chunk)))
        # CTA barrier with release/acquire: publishes the mbarrier inits and the
        # schedule written above to every thread.
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=False)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))
        total_tiles = s_tile_begin[E]
        warp_group = cute.arch.make_warp_uniform(tidx // 128)

        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._produce(
                    tma_atom_a, mA, tma_atom_b, mB, sA, sB, mainloop, bidx, total_tiles,
                    s_tile_begin, s_row_start, s_row_count,
                )
            elif warp_idx == SCALE_WARP:
                if cutlass.const_expr(st is not None):
                    self._stage_scales(mSFA, mSFB, sSA, sSB, scales, rows, bidx, total_tiles, s_tile_begin,
                                       s_row_start, s_row_count)
            elif warp_idx >= STORE_WARPS[0]:
                self._store_tiles(sEpi, mC, rows, tidx - 32 * STORE_WARPS[0], bidx, total_tiles, s_tile_begin,
                                  s_row_start, s_row_count)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._consume(
                tiled_mma, sA, sB, sBmma, sEpi, mSFA, mSFB, sSA, sSB, scales, mRowW, rows, mainloop, tidx - 128,
                bidx, total_tiles, s_tile_begin, s_row_start, s_row_count,
            )

    @cute.jit
    def _build_schedule(self, mGroups, rows, s_tile_begin, s_row_start, s_row_count):
        """Warp 0: per-expert rows and the prefix sum of output tiles, into smem."""
        cfg = self.cfg
        lane = cute.arch.lane_idx()
        carry = cutlass.Int32(0)
        if lane == 0:
            s_tile_begin[0] = cutlass.Int32(0)
        for chunk in cutlass.range_constexpr((cfg.num_experts + 31) // 32):
            e = chunk * 32 + lane
            start = cutlass.Int32(0)
            count = cutlass.Int32(0)
            if e < cfg.num_experts:
                if cutlass.const_expr(cfg.masked):
                    count = mGroups[e]
                    if count > rows:
                        count = rows
                else:
                    start = mGroups[e]
                    count = mGroups[e + 1] - start
                if count < 0:
                    count = cutlass.Int32(0)
            tiles = (count + cfg.tile_m - 1) // cfg.tile_m * self.n_tiles
            # inclusive warp scan of the tile counts
            for step in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(tiles, 1 << step)
                if lane >= (1 << step):
                    tiles = tiles + other
            if e < cfg.num_experts:
                s_tile_begin[e + 1] = carry + tiles
                s_row_start[e] = start
                s_row_count[e] = count
            carry = carry + cute.arch.shuffle_sync(tiles, 31)

    @cute.jit
    def _locate(self, tile, expert, s_tile_begin, s_row_start, s_row_count):
        """Where output ``tile`` is: ``(expert, n_tile, batch, row0, rows_left)``.

        ``expert`` advances from the caller's previous value (a CTA's tiles come
        in order).  Tiles run N-major, M-minor inside an expert, so the CTAs
        working at the same time share weight tiles in L2.  ``row0`` is the
        tile's first row in its batch (masked layout: batch = expert), and
        ``rows_left`` how many rows from there belong to the expert.
        """
        cfg = self.cfg
        while tile >= s_tile_begin[expert + 1]:
            expert = expert + 1
        local = tile - s_tile_begin[expert]
        m_tiles = (s_row_count[expert] + cfg.tile_m - 1) // cfg.tile_m
        n_tile = local // m_tiles
        m_row = (local - n_tile * m_tiles) * cfg.tile_m
        batch = expert if cutlass.const_expr(cfg.masked) else 0
        return expert, n_tile, batch, s_row_start[expert] + m_row, s_row_count[expert] - m_row

    @cute.jit
    def _produce(self, tma_atom_a, mA, tma_atom_b, mB, sA, sB, mainloop, first_tile, total_tiles,
                 s_tile_begin, s_row_start, s_row_count):
        cfg = self.cfg
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        gB = cute.local_tile(mB, (cfg.tile_n, self.tile_k), (None, None, None))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        tile = first_tile
        expert = cutlass.Int32(0)
        while tile < total_tiles:
            expert, n_tile, batch, row0, _ = self._locate(tile, expert, s_tile_begin, s_row_start, s_row_count)
            # The expert's rows start at an arbitrary row (contiguous layout): offset
            # the TMA coordinate space to the tile's first row, then tile.
            gA = cute.local_tile(cute.domain_offset((row0, 0, 0), mA), (cfg.tile_m, self.tile_k), (None, None, None))
            tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
            )
            tAgA_t = tAgA[(None, 0, None, batch)]
            tBgB_t = tBgB[(None, n_tile, None, expert)]
            for k_tile in cutlass.range(self.k_tiles, unroll=1):
                mainloop.producer_acquire(state)
                barrier = mainloop.producer_get_barrier(state)
                cute.copy(tma_atom_a, tAgA_t[(None, k_tile)], tAsA[(None, state.index)], tma_bar_ptr=barrier)
                cute.copy(tma_atom_b, tBgB_t[(None, k_tile)], tBsB[(None, state.index)], tma_bar_ptr=barrier)
                mainloop.producer_commit(state)
                state.advance()
            tile = tile + cfg.num_sms
        mainloop.producer_tail(state)

    @cute.jit
    def _store_tiles(self, sEpi, mC, rows, store_tidx, first_tile, total_tiles, s_tile_begin, s_row_start,
                     s_row_count):
        """Store warps: every output tile of this CTA, in the consumers' order, from shared to global memory."""
        cfg = self.cfg
        store = self._store_setup(sEpi, store_tidx)
        tile = first_tile
        expert = cutlass.Int32(0)
        while tile < total_tiles:
            expert, n_tile, batch, row0, rows_left = self._locate(tile, expert, s_tile_begin, s_row_start,
                                                                  s_row_count)
            self._store_tile(store, mC, rows, row0, rows_left, n_tile, batch)
            tile = tile + cfg.num_sms

    @cute.jit
    def _consume(self, tiled_mma, sA, sB, sBmma, sEpi, mSFA, mSFB, sSA, sSB, scales, mRowW, rows, mainloop, mma_tidx,
                 first_tile, total_tiles, s_tile_begin, s_row_start, s_row_count):
        cfg = self.cfg
        thr_mma = tiled_mma.get_slice(mma_tidx)
        wg = cute.arch.make_warp_uniform(mma_tidx // 128)  # consumer warpgroup index
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sBmma)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        num_k_blocks = cute.size(tCrA, mode=[2])

        # Coordinates of this thread's accumulator elements inside a tile.
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
        acc = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
        # FP8: K blocks' products before scaling (128-wide tiles use both, 192-wide one)
        part0 = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
        part1 = cute.make_rmem_tensor(tCcC.shape, self.acc_dtype)
        epi = self._epilogue_setup(tiled_mma, sEpi, acc, mma_tidx)
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        scale_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ScaleStaging.STAGES)

        if cutlass.const_expr(self.turns):
            if wg == 1:
                self._pass_turn(wg)  # warpgroup 0 issues first
        tile = first_tile
        expert = cutlass.Int32(0)
        while tile < total_tiles:
            expert, n_tile, batch, row0, _ = self._locate(tile, expert, s_tile_begin, s_row_start, s_row_count)
            # The pipeline states are assigned here, not only mutated in the callee,
            # so that the DSL carries them across iterations of this tile loop.
            if cutlass.const_expr(cfg.fp8):
                read_state, release_state, scale_state = self._mainloop_block_scaled(
                    tiled_mma, tCrA, tCrB, num_k_blocks, acc, part0, part1, tCcC, mSFA, mSFB, sSA, sSB, rows, row0,
                    batch, expert, n_tile, wg, mainloop, read_state, release_state, scales, scale_state,
                )
            elif cutlass.const_expr(cfg.mxfp8):
                read_state, release_state = self._mainloop_mx(
                    tiled_mma, tCrA, tCrB, num_k_blocks, acc, sB, sBmma, mSFB, expert, n_tile, mma_tidx,
                    mainloop, read_state, release_state,
                )
            else:
                read_state, release_state = self._mainloop(
                    tiled_mma, tCrA, tCrB, num_k_blocks, acc, wg, mainloop, read_state, release_state
                )
            self._epilogue(acc, tCcC, epi, mRowW, rows, row0, batch, wg)
            tile = tile + cfg.num_sms
        if cutlass.const_expr(self.turns):
            if wg == 0:
                self._take_turn(wg)  # the turn warpgroup 1 passed after its last block: both barriers end balanced

    @cute.jit
    def _mma_stage(self, tiled_mma, acc, tCrA, tCrB, num_k_blocks, a_stage, b_stage,
                   fresh: cutlass.Constexpr = False):
        """Issue one K stage's WGMMAs (A from smem stage ``a_stage``, B from ``b_stage``) as one batch, not waited for.

        ``fresh``: the first WGMMA overwrites ``acc`` instead of adding to it.
        """
        cute.nvgpu.warpgroup.fence()
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, not fresh)
        for kb in cutlass.range_constexpr(num_k_blocks):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, a_stage)], tCrB[(None, None, kb, b_stage)], acc)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _mainloop(self, tiled_mma, tCrA, tCrB, num_k_blocks, acc, wg, mainloop, read_state, release_state):
        """bf16: accumulate the whole K range in one fp32 accumulator, one WGMMA batch in flight.

        With two consumer warpgroups they take turns to issue each stage's WGMMAs
        (``_take_turn`` / ``_pass_turn``, as the FP8 192-wide tiles do), so that
        warpgroup 0's last batch of a tile finishes half a stage before warpgroup
        1's and its epilogue runs under those WGMMAs, and warpgroup 1's under
        warpgroup 0's first batch of the next tile; issued together, both batches
        finished together and both epilogues left the tensor cores idle.  On an
        H200 (a371ffeef6e4, same GPU, same call, A/B by a temporary switch)
        bf16 prefill moved -0.7..+2.5% sustained, 0..+2% in bursts, by shape.
        """
        acc.fill(0.0)
        for k_tile in cutlass.range(self.k_tiles, unroll=1):
            mainloop.consumer_wait(read_state)
            if cutlass.const_expr(self.bf16_turns):
                self._take_turn(wg)
            self._mma_stage(tiled_mma, acc, tCrA, tCrB, num_k_blocks, read_state.index, read_state.index)
            if cutlass.const_expr(self.bf16_turns):
                self._pass_turn(wg)
            # Keep this batch in flight; the previous one is done, free its stage.
            cute.nvgpu.warpgroup.wait_group(1)
            if k_tile > 0:
                mainloop.consumer_release(release_state)
                release_state.advance()
            read_state.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        mainloop.consumer_release(release_state)
        release_state.advance()
        return read_state, release_state
