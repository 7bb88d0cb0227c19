// Slot map (CPU twin: cpu::slot_map): a streaming pass's router chose experts `ids` for one MoE
// layer; the expert kernels want the VRAM slots that hold them. `table` (per layer, expert →
// slot, NONE when no slot holds it) is the host's slot table kept in GPU memory. When every
// chosen expert has a slot, ids become slots and the pass runs on without the host. When one
// has none, the pass halts here: every indirect dispatch's launch counts are zeroed (the
// dispatches after this one then run no workgroups) and status records 1 + this layer, so the
// host can fill the slots and resume at this layer's experts. Either way the expert ids are
// kept in `chosen` for the host. A slot map after a halt does nothing.
//
// A layer with a lookahead (the next MoE layer's router on this layer's input) also halts
// when a guessed expert has no slot in that layer (`guess`, `next_off`): the host then starts
// reading the guesses before the pass goes on, as at a stop — running through such a layer
// would leave the next layer's misses unguessed. Only each token's `guess_keep` best-ranked
// guesses of its `guess_k` count (the top-k writes them in rank order): the host reads no
// others.
//
// SPEC: a speculative pass (the host runs one while it reads a halted layer's misses, to learn
// which experts the next layers will choose): it never halts and ignores status; an expert no
// slot holds is left out — slot 0 (whatever it holds, the product is finite) with router weight
// 0 in rw — so the pass runs on with that layer's output short of the missing experts' share.

struct Params {
    layer: u32,
    count: u32,      // chosen ids: tokens × top-k
    experts: u32,    // experts per layer
    args_words: u32, // u32 words of indirect launch counts to zero on a halt
    ids_off: u32,
    table_off: u32,  // this layer's row of the table
    chosen_off: u32, // this layer's place in chosen
    guess_count: u32, // lookahead ids (0: none)
    guess_off: u32,
    next_off: u32,    // the next MoE layer's row of the table
    rw_off: u32,      // SPEC: index of the first chosen id's router weight in rw
    guess_k: u32,     // lookahead ids per token
    guess_keep: u32,  // of them, the best-ranked that count
    _pad: u32,
}

const NONE: u32 = 0xffffffffu;

override SPEC: bool = false;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> ids: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<u32>;
@group(0) @binding(3) var<storage, read_write> chosen: array<u32>;
@group(0) @binding(4) var<storage, read_write> args: array<u32>;
@group(0) @binding(5) var<storage, read_write> status: array<u32>;
@group(0) @binding(6) var<storage, read> guess: array<u32>;
@group(0) @binding(7) var<storage, read_write> rw: array<f32>;

var<workgroup> missed: atomic<u32>;
var<workgroup> halted: u32;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) i: u32) {
    if (SPEC) {
        for (var j = i; j < p.count; j += 64u) {
            let e = ids[p.ids_off + j];
            chosen[p.chosen_off + j] = e;
            var s = NONE;
            if (e < p.experts) {
                s = table[p.table_off + e];
            }
            if (s == NONE) {
                ids[p.ids_off + j] = 0u;
                rw[p.rw_off + j] = 0.0;
            } else {
                ids[p.ids_off + j] = s;
            }
        }
        return;
    }
    if (i == 0u) {
        atomicStore(&missed, 0u);
        halted = status[0];
    }
    workgroupBarrier();
    // An earlier layer halted the pass: this layer's router did not run.
    if (workgroupUniformLoad(&halted) != 0u) {
        return;
    }
    for (var j = i; j < p.count; j += 64u) {
        let e = ids[p.ids_off + j];
        chosen[p.chosen_off + j] = e;
        if (e >= p.experts || table[p.table_off + e] == NONE) {
            atomicStore(&missed, 1u);
        }
    }
    for (var j = i; j < p.guess_count; j += 64u) {
        let e = guess[p.guess_off + j];
        if (j % p.guess_k < p.guess_keep && e < p.experts && table[p.next_off + e] == NONE) {
            atomicStore(&missed, 1u);
        }
    }
    workgroupBarrier();
    if (atomicLoad(&missed) == 0u) {
        for (var j = i; j < p.count; j += 64u) {
            ids[p.ids_off + j] = table[p.table_off + chosen[p.chosen_off + j]];
        }
    } else {
        for (var w = i; w < p.args_words; w += 64u) {
            args[w] = 0u;
        }
        if (i == 0u) {
            status[0] = p.layer + 1u;
        }
    }
}
