//! What is not a comparison of one op's values: the streaming slot map, which halts a pass
//! (the indirect dispatches after it run no workgroups) or maps ids to VRAM slots.

use super::cases::ops::cpu_argmax;
use super::{gpu, rand_vec};
use smoe_compute::cpu::ops;
use smoe_compute::gpu::{Argmax, BufRef};

/// The streaming slot map against `cpu::ops::slot_map`: where every chosen expert has a slot,
/// ids become slots and the indirect dispatches after it run; where one has none, the pass
/// halts (status = 1 + layer; the indirect dispatches after it run no workgroups, those before
/// it did); after a halt, a later slot map does nothing. Expert ids are kept for the host in
/// either case. Odd sizes: 60 experts, 2 tokens × top-6 in rows of 24. A lookahead guess that no
/// slot holds halts it too, if among its token's best-ranked kept. A speculative map never
/// halts, even after a halt: an expert without a slot goes to slot 0 with router weight 0.
#[test]
fn slot_map_maps_or_halts_the_pass() {
    use smoe_compute::gpu::{wgpu, IndirectArgs, Launch, SlotGuess, SlotMap, SlotMapBufs, NO_SLOT};
    let Some(ctx) = gpu() else { return };
    let (layers, experts, count, row) = (3, 60, 12, 24);
    // Layer l's table: expert e in slot (e·7 + l) % 40, except every fifth expert of layer 2.
    let table: Vec<u32> = (0..layers * experts)
        .map(|i| {
            let (l, e) = (i / experts, i % experts);
            match l == 2 && e % 5 == 0 {
                true => NO_SLOT,
                false => ((e * 7 + l) % 40) as u32,
            }
        })
        .collect();
    let hits: Vec<u32> = (0..count as u32)
        .map(|j| (j * 11 + 1) % 60)
        .filter(|e| e % 5 != 0)
        .collect();
    let hits = [&hits[..], &hits[..]].concat()[..count].to_vec();
    let mut misses = hits.clone();
    misses[7] = 35; // no slot in layer 2 (the second token's second-ranked)
    let logits = rand_vec(1000, 9, 1.0);
    // (layer, ids, halted before, lookahead guesses for layer 2 and how many per token count)
    let cases = [
        (1usize, &hits, 0u32, None),
        (2, &hits, 0, None),
        (2, &misses, 0, None),
        (1, &hits, 2, None),
        (0, &hits, 0, Some((&hits, 6))),
        (0, &hits, 0, Some((&misses, 6))),
        (0, &hits, 0, Some((&misses, 2))),
        (0, &hits, 0, Some((&misses, 1))),
    ];
    // What a slot map reads and writes: ids, the table, chosen ids (poisoned), the status.
    let upload = |ids: &[u32], status: u32| {
        (
            ctx.upload("ids", bytemuck::cast_slice(ids)),
            ctx.upload("table", bytemuck::cast_slice(&table)),
            ctx.upload("chosen", &vec![0xEE; 4 * layers * row]),
            ctx.upload("status", bytemuck::cast_slice(&[status, 0, 0, 0])),
        )
    };
    for (layer, ids, pre_halted, guess) in cases {
        let what =
            format!("layer {layer}, ids {ids:?}, halted before: {pre_halted}, guess {guess:?}");
        let (idb, tb, cb, sb) = upload(ids, pre_halted);
        let gb = ctx.upload("guess", bytemuck::cast_slice(guess.map_or(ids, |g| g.0)));
        let mut args = IndirectArgs::new(ctx, 8);
        let b = SlotMapBufs {
            ids: BufRef::new(&idb),
            table: &tb,
            chosen: &cb,
            args: &args,
            status: &sb,
            guess: guess.map(|(_, keep)| SlotGuess {
                ids: BufRef::new(&gb),
                layer: 2,
                per_token: 6,
                keep,
            }),
            spec: None,
        };
        let map = SlotMap::new(ctx, &b, layer, experts, count, row).unwrap();
        // An argmax before the slot map and one after it, both launched indirectly.
        let xb = ctx.upload_f32("logits", &logits);
        let (before, after) = (
            ctx.upload("before", &[0xFF; 16]),
            ctx.upload("after", &[0xFF; 16]),
        );
        let am = |out: &wgpu::Buffer| {
            Argmax::new(ctx, BufRef::new(&xb), BufRef::new(out), logits.len(), 1).unwrap()
        };
        let (a0, a1) = (am(&before), am(&after));
        let mut enc = ctx.encoder();
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            let mut launch = Launch::Indirect(&mut args);
            a0.record_with(&mut pass, &mut launch);
            map.record_with(&mut pass, &mut launch);
            a1.record_with(&mut pass, &mut launch);
        }
        assert_eq!(args.len(), 2, "{what}: the slot map launches directly");
        args.upload(&ctx.queue);
        ctx.submit_wait(enc);
        let read = |buf: &wgpu::Buffer, n: usize| ctx.read_u32(buf, 0, n).unwrap();
        let want = cpu_argmax(&logits);
        assert_eq!(
            read(&before, 1)[0],
            want,
            "{what}: the dispatch before it ran"
        );
        let chosen = read(&cb, layers * row);
        let row_of = |l: usize| &table[l * experts..(l + 1) * experts];
        // A guess of layer 2 that no slot holds halts the pass like a miss, if kept.
        let kept = |(g, keep): (&Vec<u32>, usize)| -> Vec<u32> {
            g.chunks(6).flat_map(|t| &t[..keep]).copied().collect()
        };
        let mapped = ops::slot_map(ids, row_of(layer))
            .filter(|_| guess.is_none_or(|g| ops::slot_map(&kept(g), row_of(2)).is_some()));
        if pre_halted != 0 {
            assert_eq!(read(&sb, 1)[0], pre_halted, "{what}");
            assert_eq!(read(&idb, count), *ids, "{what}: ids left alone");
            assert!(
                chosen.iter().all(|&c| c == 0xEEEE_EEEE),
                "{what}: chosen left alone"
            );
            continue;
        }
        assert_eq!(
            &chosen[layer * row..layer * row + count],
            &ids[..],
            "{what}: chosen ids"
        );
        let others = (0..layers * row).filter(|i| !(layer * row..layer * row + count).contains(i));
        assert!(
            others.into_iter().all(|i| chosen[i] == 0xEEEE_EEEE),
            "{what}: only its row"
        );
        match mapped {
            Some(slots) => {
                assert_eq!(read(&idb, count), slots, "{what}: slots");
                assert_eq!(read(&sb, 1)[0], 0, "{what}: ran on");
                assert_eq!(
                    read(&after, 1)[0],
                    want,
                    "{what}: the dispatch after it ran"
                );
            }
            None => {
                assert_eq!(read(&sb, 1)[0], layer as u32 + 1, "{what}: halted");
                assert_eq!(
                    read(&after, 1)[0],
                    u32::MAX,
                    "{what}: the dispatch after it did not run"
                );
                assert!(
                    read(args.buffer(), 6).iter().all(|&w| w == 0),
                    "{what}: counts zeroed"
                );
            }
        }
    }
    // Speculative, on a pass an earlier layer halted: misses left out, nothing halted.
    let mut ids = misses.clone();
    ids[3] = 99; // not an expert: left out too
    let weights = rand_vec(count, 3, 1.0);
    let (idb, tb, cb, sb) = upload(&ids, 2);
    let wb = ctx.upload_f32("weights", &weights);
    let args = IndirectArgs::new(ctx, 8);
    let b = SlotMapBufs {
        ids: BufRef::new(&idb),
        table: &tb,
        chosen: &cb,
        args: &args,
        status: &sb,
        guess: None,
        spec: Some(BufRef::new(&wb)),
    };
    let map = SlotMap::new(ctx, &b, 2, experts, count, row).unwrap();
    let mut enc = ctx.encoder();
    map.encode(&mut enc);
    ctx.submit_wait(enc);
    let want = ops::slot_map_spec(&ids, &table[2 * experts..3 * experts]);
    assert!(want.iter().filter(|s| s.is_none()).count() >= 2);
    let got_w = ctx.read_f32(&wb, 0, count).unwrap();
    let got_s = ctx.read_u32(&idb, 0, count).unwrap();
    for (j, (&slot, w)) in got_s.iter().zip(got_w).enumerate() {
        let (ws, ww) = match want[j] {
            Some(s) => (s, weights[j]),
            None => (0, 0.0),
        };
        assert_eq!((slot, w), (ws, ww), "speculative, slot {j}");
    }
    let chosen = ctx.read_u32(&cb, 0, layers * row).unwrap();
    assert_eq!(
        &chosen[2 * row..2 * row + count],
        &ids[..],
        "speculative: chosen ids"
    );
    assert_eq!(
        ctx.read_u32(&sb, 0, 1).unwrap()[0],
        2,
        "speculative: status left alone"
    );
    // Shapes it cannot serve are refused.
    let small = ctx.upload("small", &[0; 16]);
    let args = IndirectArgs::new(ctx, 1);
    let b = SlotMapBufs {
        ids: BufRef::new(&small),
        table: &small,
        chosen: &small,
        args: &args,
        status: &small,
        guess: None,
        spec: None,
    };
    assert!(
        SlotMap::new(ctx, &b, 0, 60, 4, 4).is_err(),
        "a table without the layer's row"
    );
    assert!(
        SlotMap::new(ctx, &b, 0, 4, 8, 4).is_err(),
        "more ids than a row holds"
    );
}
