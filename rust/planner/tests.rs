//! The planner's pure parts: how much prefill a step has room for, how long a
//! chunk is, and the plan arrays exactly as the contract lays them out.

use super::*;

// ---------------------------------------------------------------------------
// prefill_room

#[test]
fn prefill_gets_what_the_budget_leaves() {
    assert_eq!(prefill_room(64, 10, 10, 64), 54);
    assert_eq!(prefill_room(64, 0, 0, 64), 64, "an empty step");
    assert_eq!(prefill_room(64, 63, 10, 64), 1, "one token left");
    assert_eq!(prefill_room(64, 64, 10, 64), 0, "filled, prefills included");
}

#[test]
fn a_zero_budget_has_no_room() {
    assert_eq!(prefill_room(0, 0, 0, 64), 0);
    assert_eq!(prefill_room(0, 0, 0, 0), 0);
}

#[test]
fn a_cap_filled_by_decodes_alone_still_lets_the_first_prefill_move() {
    // A tenant's cap of 8 with 10 decodes running: the first prefill still
    // gets up to the cap, within max_batched_tokens.
    assert_eq!(prefill_room(8, 10, 10, 64), 8);
    assert_eq!(
        prefill_room(8, 10, 10, 12),
        2,
        "max_batched_tokens bounds it"
    );
    assert_eq!(prefill_room(8, 8, 8, 64), 8, "decodes exactly fill the cap");
    assert_eq!(prefill_room(8, 64, 64, 64), 0, "the step is full");
    assert_eq!(prefill_room(8, 70, 70, 64), 0, "past it: no underflow");
}

#[test]
fn once_a_prefill_is_placed_a_full_budget_has_no_room() {
    // 10 scheduled, 9 of them decodes: a prefill already moved this step.
    assert_eq!(prefill_room(8, 10, 9, 64), 0);
    assert_eq!(prefill_room(10, 10, 9, 64), 0, "exact fit");
}

// ---------------------------------------------------------------------------
// prefill_chunk

#[test]
fn a_chunk_is_the_least_of_need_chunk_limit_room_and_coverable() {
    assert_eq!(prefill_chunk(100, 16, 50, None), 16, "the chunk limit");
    assert_eq!(prefill_chunk(100, 16, 10, None), 10, "the room");
    assert_eq!(
        prefill_chunk(5, 16, 50, None),
        5,
        "what is left of the prompt"
    );
    assert_eq!(
        prefill_chunk(100, 16, 50, Some(3)),
        3,
        "what its pages cover"
    );
    assert_eq!(prefill_chunk(100, 16, 50, Some(40)), 16);
    assert_eq!(prefill_chunk(16, 16, 16, Some(16)), 16, "all equal");
}

#[test]
fn a_chunk_is_empty_when_any_bound_is_zero() {
    assert_eq!(prefill_chunk(0, 16, 50, None), 0);
    assert_eq!(prefill_chunk(100, 16, 0, None), 0);
    assert_eq!(prefill_chunk(100, 16, 50, Some(0)), 0);
    assert_eq!(
        prefill_chunk(usize::MAX, usize::MAX, usize::MAX, None),
        usize::MAX
    );
}

// ---------------------------------------------------------------------------
// write_plan and validate

/// 9 pages of 4 tokens (page 0 the null page), 4 rows of 4 pages, buckets
/// 16 and 32.
struct Fixture {
    shape: PlanShape,
    buckets: TokenBuckets,
    pool: BlockPool,
    bufs: OwnedPlanBuffers,
    rows: RowCache,
}

fn fixture() -> Fixture {
    let buckets = TokenBuckets::powers_of_two(32);
    let shape = PlanShape {
        max_tokens: buckets.largest(),
        max_seqs: 4,
        pages_per_seq: 4,
        block_size: BlockSize::new(4),
        pad_slot: 9 * 4,
        num_groups: 1,
    };
    Fixture {
        bufs: OwnedPlanBuffers::new(&shape),
        rows: RowCache::new(shape.max_seqs),
        pool: BlockPool::new(9, 4).unwrap(),
        shape,
        buckets,
    }
}

fn seq<'a>(
    row_key: u64,
    tokens: &'a [i32],
    start: usize,
    q_len: usize,
    pages: &'a [u32],
) -> SeqSlice<'a> {
    SeqSlice {
        row_key,
        tokens,
        start,
        q_len,
        pages,
    }
}

fn split_decodes(
    num_decode: usize,
    mut seqs: Vec<SeqSlice<'_>>,
) -> (Vec<SeqSlice<'_>>, Vec<SeqSlice<'_>>) {
    let chunks = seqs.split_off(num_decode.min(seqs.len()));
    (seqs, chunks)
}

/// A decode slice as the running set's hot record: its token at `start`.
fn decode_record(d: &SeqSlice<'_>) -> DecodeSeq {
    assert_eq!(d.q_len, 1, "a decode runs one token");
    DecodeSeq {
        row_key: d.row_key,
        pos: d.start,
        token: d.tokens[d.start],
        last_page: d.pages.last().copied().unwrap_or(0),
        num_pages: d.pages.len(),
    }
}

impl Fixture {
    fn pages(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.pool.allocate_one().unwrap()).collect()
    }

    /// write_plan alone: its own checks. The first `num_decode` slices are the
    /// decodes (one token at `start`), handed over as the scheduler keeps them:
    /// `DecodeSeq` records, with their page lists behind `pages_of`.
    fn write(&mut self, num_decode: usize, seqs: Vec<SeqSlice<'_>>) -> KvResult<WrittenPlan> {
        let (decodes, chunks) = split_decodes(num_decode, seqs);
        let page_lists: Vec<&[u32]> = decodes.iter().map(|d| d.pages).collect();
        let records: Vec<DecodeSeq> = decodes.iter().map(decode_record).collect();
        write_plan(
            &self.shape,
            &self.buckets,
            &mut self.bufs.as_mut(),
            &mut self.rows,
            &self.pool,
            &records,
            chunks.into_iter(),
            |i| page_lists[i],
        )
    }

    /// write_plan, then the full re-read of what it wrote.
    fn write_checked(
        &mut self,
        num_decode: usize,
        seqs: Vec<SeqSlice<'_>>,
    ) -> KvResult<WrittenPlan> {
        let w = self.write(num_decode, seqs)?;
        validate(&self.shape, &self.bufs.as_mut(), &w, &self.pool)?;
        Ok(w)
    }
}

#[test]
fn a_plan_of_one_decode_and_one_prefill_is_laid_out_as_the_contract_says() {
    let mut f = fixture();
    let a_pages = f.pages(2); // 1, 2
    let b_pages = f.pages(2); // 3, 4
    let a: Vec<i32> = (100..106).collect(); // decode at position 5
    let b: Vec<i32> = (200..207).collect(); // prefill 3..7
    let w = f
        .write_checked(
            1,
            vec![seq(1, &a, 5, 1, &a_pages), seq(2, &b, 3, 4, &b_pages)],
        )
        .unwrap();
    assert_eq!(
        w,
        WrittenPlan {
            num_seqs: 2,
            num_tokens: 5,
            bucket: 16
        }
    );
    let b_ = &f.bufs;
    assert_eq!(&b_.token_ids[..6], &[105, 203, 204, 205, 206, 0]);
    assert_eq!(&b_.positions[..6], &[5, 3, 4, 5, 6, 0]);
    // Slot = page * 4 + offset: a's position 5 is page 2 offset 1; b's 3 is
    // page 3 offset 3, then page 4 offsets 0..2.
    assert_eq!(&b_.slot_mapping[..5], &[9, 15, 16, 17, 18]);
    assert!(
        b_.slot_mapping[5..16].iter().all(|&s| s == 36),
        "padded to the bucket"
    );
    assert_eq!(b_.cu_q_lens, vec![0, 1, 5, 5, 5]);
    assert_eq!(b_.kv_lens, vec![6, 7, 0, 0]);
    assert_eq!(
        b_.page_indices,
        vec![1, 2, 0, 0, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(b_.logits_indices, vec![0, 4, 4, 4]);
    assert_eq!(b_.num_seqs, vec![2]);
    assert_eq!(b_.distribution, vec![1, 1, 2]);
}

#[test]
fn an_empty_plan_is_all_padding() {
    let mut f = fixture();
    let w = f.write_checked(0, vec![]).unwrap();
    assert_eq!((w.num_seqs, w.num_tokens, w.bucket), (0, 0, 16));
    assert_eq!(f.bufs.logits_indices, vec![0; 4], "never -1");
    assert_eq!(f.bufs.cu_q_lens, vec![0; 5]);
    assert!(f.bufs.slot_mapping[..16].iter().all(|&s| s == 36));
    assert_eq!(f.bufs.distribution, vec![0, 0, 0]);
}

#[test]
fn a_step_one_token_over_a_bucket_takes_the_next_and_a_full_bucket_fits() {
    let mut f = fixture();
    let pages = f.pages(5);
    let t: Vec<i32> = (0..17).collect();
    assert_eq!(
        f.write_checked(0, vec![seq(1, &t, 0, 16, &pages[..4])])
            .unwrap()
            .bucket,
        16
    );
    let mut f = fixture();
    let pages = f.pages(5);
    // 17 tokens do not fit a row of 4 pages of 4; two sequences do.
    let u: Vec<i32> = (0..1).collect();
    let w = f
        .write_checked(
            0,
            vec![
                seq(1, &t, 0, 16, &pages[..4]),
                seq(2, &u, 0, 1, &pages[4..]),
            ],
        )
        .unwrap();
    assert_eq!((w.num_tokens, w.bucket), (17, 32));
}

#[test]
fn rows_follow_page_lists_that_grow_change_hands_and_empty() {
    let mut f = fixture();
    let p = f.pages(4);
    let t: Vec<i32> = (0..16).collect();
    // Two buffer sets alternate in the scheduler; one is enough here: each
    // write is checked against the page lists alone.
    f.write_checked(0, vec![seq(7, &t, 0, 4, &p[..1])]).unwrap();
    f.write_checked(1, vec![seq(7, &t, 4, 1, &p[..2])]).unwrap(); // grew a page
    assert_eq!(&f.bufs.page_indices[..4], &[1, 2, 0, 0]);
    f.write_checked(1, vec![seq(7, &t, 5, 1, &p[..2])]).unwrap(); // unchanged
    assert_eq!(&f.bufs.page_indices[..4], &[1, 2, 0, 0]);
    // Another sequence in the row (a new key), with a shorter list.
    f.write_checked(0, vec![seq(8, &t, 0, 3, &p[3..4])])
        .unwrap();
    assert_eq!(&f.bufs.page_indices[..4], &[4, 0, 0, 0]);
    // The same key, rebuilt longer by more than one page.
    f.write_checked(0, vec![seq(8, &t, 0, 12, &[4, 3, 2])])
        .unwrap();
    assert_eq!(&f.bufs.page_indices[..4], &[4, 3, 2, 0]);
    // The same key, shorter (pages given back): the tail is cleared.
    f.write_checked(0, vec![seq(8, &t, 0, 2, &[4])]).unwrap();
    assert_eq!(&f.bufs.page_indices[..4], &[4, 0, 0, 0]);
    // Gone: the row is padding again.
    f.write_checked(0, vec![]).unwrap();
    assert!(f.bufs.page_indices.iter().all(|&p| p == 0));
}

#[test]
fn a_plan_that_breaks_the_contract_is_refused() {
    let mut f = fixture();
    let p = f.pages(5);
    let t: Vec<i32> = (0..20).collect();
    let refused = |f: &mut Fixture, s: Vec<SeqSlice<'_>>| f.write(0, s).is_err();
    assert!(refused(&mut f, vec![seq(1, &t, 0, 0, &[])]), "no tokens");
    assert!(
        refused(&mut f, vec![seq(1, &t[..10], 8, 3, &p[..3])]),
        "past its tokens"
    );
    assert!(
        refused(&mut f, vec![seq(1, &t, 0, 5, &p[..1])]),
        "too few pages"
    );
    assert!(
        refused(&mut f, vec![seq(1, &t, 0, 4, &p[..2])]),
        "too many pages"
    );
    assert!(
        refused(&mut f, vec![seq(1, &t, 0, 17, &p)]),
        "more than a row"
    );
    let many: Vec<SeqSlice<'_>> = (0..5).map(|i| seq(i, &t, 0, 1, &p[..1])).collect();
    assert!(refused(&mut f, many), "more sequences than rows");
    // Exactly a row, exactly the rows: fine.
    assert!(!refused(&mut f, vec![seq(1, &t, 0, 16, &p[..4])]));
    let four: Vec<SeqSlice<'_>> = (0..4)
        .map(|i| seq(i + 1, &t, 0, 1, &p[i as usize..][..1]))
        .collect();
    assert!(!refused(&mut f, four));
}

#[test]
fn writing_into_a_page_held_twice_is_refused() {
    let mut f = fixture();
    let p = f.pages(2);
    f.pool.retain(&p[..1]).unwrap(); // page 1 shared
    let t: Vec<i32> = (0..8).collect();
    // Reading a shared page is fine; writing into one is not.
    assert!(f.write(0, vec![seq(1, &t, 4, 4, &p)]).is_ok());
    assert!(
        f.write(0, vec![seq(1, &t, 3, 1, &p[..1])]).is_err(),
        "decode"
    );
    assert!(f.write(0, vec![seq(1, &t, 2, 4, &p)]).is_err(), "prefill");
}

#[test]
fn buffers_of_the_wrong_shape_are_refused() {
    let mut f = fixture();
    f.bufs.kv_lens.push(0);
    assert!(f.write(0, vec![]).is_err());
}

type Corrupt = fn(&mut OwnedPlanBuffers);

#[test]
fn validate_catches_arrays_changed_after_writing() {
    let mut f = fixture();
    let p = f.pages(2);
    let t: Vec<i32> = (0..8).collect();
    let w = f.write_checked(0, vec![seq(1, &t, 0, 6, &p)]).unwrap();
    let check = |b: &mut OwnedPlanBuffers, pool: &BlockPool, shape: &PlanShape| {
        validate(shape, &b.as_mut(), &w, pool).is_err()
    };
    let corruptions: [(&str, Corrupt); 6] = [
        ("slot", |b| b.slot_mapping[2] += 1),
        ("position", |b| {
            // Moved one on, slot and all: only the position is wrong.
            b.positions[0] = 1;
            b.slot_mapping[0] += 1;
        }),
        ("row", |b| b.page_indices[1] = 0),
        ("pad row", |b| b.page_indices[4] = 3),
        ("pad slot", |b| b.slot_mapping[10] = 0),
        ("cu_q_lens", |b| b.cu_q_lens[1] = 5),
    ];
    // A page of the plan that became shared since.
    f.pool.retain(&p[1..]).unwrap();
    assert!(check(&mut f.bufs.clone(), &f.pool, &f.shape), "shared page");
    f.pool.free(&p[1..]).unwrap();
    for (what, corrupt) in corruptions {
        let mut b = f.bufs.clone();
        corrupt(&mut b);
        assert!(check(&mut b, &f.pool, &f.shape), "{what}");
    }
    assert!(!check(&mut f.bufs.clone(), &f.pool, &f.shape));
}
