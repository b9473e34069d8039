//! Sharing the steps between tenants: weighted fair service and per-tenant
//! step caps.

use super::*;

/// Two backlogged tenants: served tokens over time, and the largest gap.
fn fairness_run(weight_a: f64, steps: usize) -> (f64, f64, f64) {
    let mut c = config(2001, 8);
    c.max_num_seqs = 4;
    c.max_waiting = 200;
    c.max_seq_len = 64;
    let mut h = Harness::new(c);
    let mut a = tenant("a", 0, None);
    a.weight = weight_a;
    h.tenant(a);
    h.tenant(tenant("b", 0, None));
    let mut served = [0.0f64; 2];
    let mut max_gap: f64 = 0.0;
    let mut n = 0;
    for _ in 0..steps {
        // Keep both backlogged.
        for (k, name) in ["a", "b"].iter().enumerate() {
            while h.s.tenants().by_name(name).unwrap().waiting.len() < 4 {
                n += 1;
                h.s.submit(name, &prompt(16, n + k as i32), 16, h.now)
                    .unwrap();
            }
        }
        h.step();
        let out = h.outcomes.last().unwrap();
        let b = &h.bufs[out.parity];
        for (i, id) in out.request_ids.iter().enumerate() {
            let q = (b.cu_q_lens[i + 1] - b.cu_q_lens[i]) as f64;
            let tid = h.s.request(*id).map(|r| r.tenant).unwrap_or_else(|_| {
                // Finished in this commit: find its tenant from the finished record.
                if h.finished[id].tenant == "a" {
                    0
                } else {
                    1
                }
            });
            served[tid] += q;
        }
        max_gap = max_gap.max((served[0] / weight_a - served[1]).abs());
    }
    (served[0], served[1], max_gap)
}

#[test]
fn equal_weights_share_service_within_a_bound() {
    let (a, b, gap) = fairness_run(1.0, 3000);
    // Each request is 32 tokens (16 prompt + 16 generated); with 4 slots the gap
    // stays within one running set's worth of requests: 4 x 32 = 128 tokens.
    assert!(
        gap <= 128.0,
        "largest service gap {gap} tokens (served {a} vs {b})"
    );
    assert!((a / b - 1.0).abs() < 0.02, "served {a} vs {b}");
}

#[test]
fn weights_two_to_one_converge_to_two_to_one() {
    let (a, b, _) = fairness_run(2.0, 3000);
    let ratio = a / b;
    assert!((ratio - 2.0).abs() < 0.05, "service ratio {ratio}");
}

#[test]
fn max_step_tokens_bounds_the_step_while_that_tenant_runs() {
    let mut c = config(801, 8);
    c.max_batched_tokens = 256;
    c.long_prefill_chunk = 256;
    c.max_seq_len = 1024;
    let mut h = Harness::new(c);
    let mut chat = tenant("chat", 0, None);
    chat.max_step_tokens = Some(32);
    h.tenant(chat);
    h.tenant(tenant("batch", 0, None));
    let chat_id = h.submit("chat", &prompt(8, 1), 20);
    h.submit("batch", &prompt(1000, 2), 4); // more than 20 steps of 31 tokens
    while h.s.request(chat_id).is_ok() {
        h.step();
        let out = h.outcomes.last().unwrap();
        assert!(
            out.num_tokens <= 32,
            "step of {} tokens while chat runs",
            out.num_tokens
        );
    }
    h.step();
    assert!(
        h.outcomes.last().unwrap().num_tokens > 32,
        "batch speeds up once chat is done"
    );
}

#[test]
fn a_capped_tenant_at_the_queue_head_neither_starves_nor_idles_slots() {
    let mut c = config(1001, 16);
    c.max_num_seqs = 8;
    let mut h = Harness::new(c);
    let mut x = tenant("x", 0, None);
    x.max_step_tokens = Some(2);
    h.tenant(x);
    h.tenant(tenant("b", 0, None));
    for i in 0..3 {
        h.submit("b", &prompt(4, i), 100);
    }
    h.step();
    h.step();
    h.submit("x", &prompt(4, 9), 5);
    for i in 0..3 {
        h.submit("b", &prompt(4, 10 + i), 5);
    }
    for _ in 0..20 {
        h.step();
    }
    // x enters at once (its first chunk is allowed even though the running
    // decodes alone exceed its cap), b's short requests follow once x is done,
    // and all of them finish while b's long decodes are still running.
    let st = h.s.stats(h.now);
    let finished = |name: &str| st.tenants.iter().find(|t| t.name == name).unwrap().finished;
    assert_eq!((finished("x"), finished("b")), (1, 3));
    assert_eq!((st.running, st.waiting), (3, 0));
}
