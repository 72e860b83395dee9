//! L3 object keys per owned layer range (reference/dataplane.md R-LS-3, TC-LS-03; DESIGN contract 6
//! "L3 keys are per owned layer range").
//!
//! Under LayerSplit a rank holds only some layers of a page, so its L3 object for that page holds only
//! those layers. The key therefore names, besides the [`PageKey`] of the prefix, the CP coordinates and
//! the layer range: `"{page}-cp{rank}of{size}-l{first}-{end}"` (`end` exclusive). Two ranks of one
//! group own disjoint layer ranges, so their keys never coincide and neither overwrites the other; a
//! group with another CP size uses another namespace, so its objects are never read as ours.

use std::fmt;
use std::ops::Range;

use crate::tier::page_key::PageKey;

use super::ownership::OwnerMap;

/// Key of the L3 object holding layers `layers` of one page, written by CP rank `cp_rank`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LayerRangeKey {
    /// The page's prefix key.
    pub page: PageKey,
    /// Writer's CP rank.
    pub cp_rank: u32,
    /// CP size of the writer's group.
    pub cp_size: u32,
    /// Layers held, `start..end`.
    pub layers: Range<u32>,
}

impl LayerRangeKey {
    /// The keys rank `cp_rank` writes for `page`: one per owned contiguous layer range of `map`.
    pub fn for_rank(map: &OwnerMap, cp_rank: u32, page: PageKey) -> Vec<LayerRangeKey> {
        map.owned_ranges(cp_rank)
            .into_iter()
            .map(|layers| LayerRangeKey {
                page,
                cp_rank,
                cp_size: map.cp_size(),
                layers,
            })
            .collect()
    }
}

impl fmt::Display for LayerRangeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}-cp{}of{}-l{}-{}",
            self.page, self.cp_rank, self.cp_size, self.layers.start, self.layers.end
        )
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::config::LayerSplit;

    #[test]
    fn ranks_never_share_a_key_and_ranges_cover_all_layers() {
        let pages = PageKey::chain_sequence(&(0..64).collect::<Vec<u32>>(), 16);
        for map in [
            OwnerMap::contiguous(61, 4).unwrap(),
            OwnerMap::contiguous(8, 2).unwrap(),
            OwnerMap::new(
                &LayerSplit {
                    owners: vec![0, 1, 0, 1, 1, 0],
                },
                2,
            )
            .unwrap(),
        ] {
            let mut names = BTreeSet::new();
            for page in &pages {
                let mut covered = vec![0u32; map.layers() as usize];
                for rank in 0..map.cp_size() {
                    for key in LayerRangeKey::for_rank(&map, rank, *page) {
                        assert!(names.insert(key.to_string()), "duplicate key {key}");
                        for l in key.layers.clone() {
                            covered[l as usize] += 1;
                        }
                    }
                }
                assert!(covered.iter().all(|c| *c == 1));
            }
        }
        let one = LayerRangeKey::for_rank(&OwnerMap::contiguous(8, 2).unwrap(), 1, pages[0]);
        assert_eq!(one[0].to_string(), format!("{}-cp1of2-l4-8", pages[0]));
        let other_size = LayerRangeKey::for_rank(&OwnerMap::contiguous(8, 4).unwrap(), 1, pages[0]);
        assert_ne!(one[0].to_string(), other_size[0].to_string());
    }
}
