//! KV pool page lifetime under random operation sequences (reference/dataplane.md R-MEM-5, TC-MEM-01):
//! a page is never handed out while its owner, a writer or a reader still holds it, and every page is
//! accounted for in exactly one state.

use std::collections::BTreeMap;

use proptest::prelude::*;
use tandem_worker::memory::Allocator;
use tandem_worker::memory::mmap::MmapBackend;
use tandem_worker::memory::pool::{KvPool, PageId, PoolLayout, PoolRole, PoolSpec};
use tandem_worker::model::{Attention, ModelIdentity};

const PAGES: u32 = 16;

#[derive(Debug, Clone)]
enum Op {
    Allocate(usize),
    Free(usize),
    PinWriter(usize),
    UnpinWriter(usize),
    PinReader(usize),
    UnpinReader(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1usize..5).prop_map(Op::Allocate),
        any::<usize>().prop_map(Op::Free),
        any::<usize>().prop_map(Op::PinWriter),
        any::<usize>().prop_map(Op::UnpinWriter),
        any::<usize>().prop_map(Op::PinReader),
        any::<usize>().prop_map(Op::UnpinReader),
    ]
}

#[derive(Debug, Default, Clone, Copy)]
struct Model {
    owned: bool,
    writers: u32,
    readers: u32,
}

fn pool() -> (Allocator, KvPool) {
    let a = Allocator::new("prop", MmapBackend::new());
    let spec = PoolSpec {
        role: PoolRole::Target,
        model: ModelIdentity {
            name: "p".into(),
            layers: 2,
            attention: Attention::Mha {
                kv_heads: 1,
                head_dim: 4,
            },
            dtype_bytes: 1,
            row_extra_bytes: 0,
        },
        page_tokens: 4,
        pages: PAGES,
        layout: PoolLayout::LayerFirst,
    };
    let p = KvPool::new(spec, &a).unwrap();
    (a, p)
}

proptest! {
    #[test]
    fn pages_are_never_handed_out_while_held(ops in proptest::collection::vec(op(), 1..200)) {
        let (alloc, pool) = pool();
        let mut model: BTreeMap<u32, Model> = BTreeMap::new();
        let pick = |model: &BTreeMap<u32, Model>, i: usize| -> Option<u32> {
            let keys: Vec<u32> = model.keys().copied().collect();
            (!keys.is_empty()).then(|| keys[i % keys.len()])
        };
        for op in ops {
            match op {
                Op::Allocate(n) => match pool.allocate(n) {
                    Ok(pages) => {
                        for p in pages {
                            prop_assert!(!model.contains_key(&p.0), "{p} handed out while held");
                            model.insert(p.0, Model { owned: true, ..Model::default() });
                        }
                    }
                    Err(_) => prop_assert!(PAGES as usize - model.len() < n),
                },
                Op::Free(i) => if let Some(p) = pick(&model, i) {
                    let m = model[&p];
                    let r = pool.free(&[PageId(p)]);
                    prop_assert_eq!(r.is_ok(), m.owned);
                    if m.owned {
                        let e = model.get_mut(&p).unwrap();
                        e.owned = false;
                        if e.writers == 0 && e.readers == 0 { model.remove(&p); }
                    }
                },
                Op::PinWriter(i) | Op::PinReader(i) => if let Some(p) = pick(&model, i) {
                    let writer = matches!(op, Op::PinWriter(_));
                    let r = if writer { pool.pin_writer(PageId(p)) } else { pool.pin_reader(PageId(p)) };
                    prop_assert!(r.is_ok());
                    let e = model.get_mut(&p).unwrap();
                    if writer { e.writers += 1 } else { e.readers += 1 }
                },
                Op::UnpinWriter(i) | Op::UnpinReader(i) => if let Some(p) = pick(&model, i) {
                    let writer = matches!(op, Op::UnpinWriter(_));
                    let m = model[&p];
                    let held = if writer { m.writers } else { m.readers };
                    let r = if writer { pool.unpin_writer(PageId(p)) } else { pool.unpin_reader(PageId(p)) };
                    prop_assert_eq!(r.is_ok(), held > 0);
                    if held > 0 {
                        let e = model.get_mut(&p).unwrap();
                        if writer { e.writers -= 1 } else { e.readers -= 1 }
                        if !e.owned && e.writers == 0 && e.readers == 0 { model.remove(&p); }
                    }
                },
            }
            let s = pool.stats();
            prop_assert_eq!(s.free + s.owned + s.draining + s.quarantined, PAGES);
            prop_assert_eq!(s.free as usize, PAGES as usize - model.len());
            prop_assert_eq!(s.owned as usize, model.values().filter(|m| m.owned).count());
        }
        drop(pool);
        prop_assert_eq!(alloc.stats().live_buffers, 0);
    }
}
