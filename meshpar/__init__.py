"""meshpar: one transformer trained on an SPMD device mesh; every parallel strategy a mesh and its rules.

The map (one idea per module; a wing is a folder):

    mesh, rules, sharding      the named axes; logical names → mesh axes; applying them (specs, gathers)
    context, layers, remat     how a step computes: the active mesh and rules, the layer scan, remat policies
    attention/                 kernels (dense, blockwise, cuDNN), zigzag order, ring / all-gather / Ulysses
    pipeline/                  schedule arithmetic, shared stage machinery, order at rest, GPipe, 1F1B
    moe/                       routing and the router's losses; the dispatch to the experts over `expert`
    loss, offload, train       chunked cross-entropy; host memory; the state, init and the jitted step
    fp8, lora, frozen, dpo     FP8 matmuls; adapters on a frozen base; frozen weights; the preference loss
    run, data, checkpoint      the loop and its hooks; batches; orbax save/restore onto any mesh
    distributed, generate      several processes; a KV-cache decoder
    metrics, mfu, hardware     what a run reports; MFU; the accelerators' datasheet figures
    compiler/                  what XLA says: collectives and FLOPs from HLO, memory, compile-only fit
    plan/                      the planner: shape, layout and validity, memory, communication, time, search
    config, errors, divisors   dotted overrides; the exceptions; tilings and factorisations

Shape letters, one meaning each across the engine (suffixes of array names, `x_BTD`, and the formulas):

    B  batch rows (global)              b  rows of one microbatch on one device
    T  sequence positions (queries)     S  key / value positions
    t, s  a part of T, S: the positions one device holds (T / sequence), or one tile of them; c a chunk
    D  d_model          F  d_ff         V  vocabulary
    N  query heads      K  kv heads     G  N / K            H  head dim         L  layers
    P  pipeline stages (p: the mesh's stage size)           M  pipeline microbatches   R  pipeline repeats
    J  layers per stage and repeat      W  1F1B stash entries
    A  gradient-accumulation steps      Z  batch shards (data × fsdp); Y the replicas among them, X the rest
    C  chunks of a sequence             Ψ  parameters       e  bytes per element of the compute dtype (planner)
    E  experts (in a device's dispatch: its share)          k  experts per token        n  a device's tokens
    Q  a device's assignments (n·k)     r  rows it sends each expert shard (x: the shards)   I  rows it receives
    U  an expert's capacity
"""
