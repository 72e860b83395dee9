//! The layer → CP-rank owner map (DESIGN contract 6; seed 004 "分层存储"; reference/dataplane.md
//! R-LS-1, TC-LS-01).
//!
//! Wraps the worker config's [`LayerSplit`] (`owners[layer] = cp_rank`, written by the operator and
//! therefore the same file on every rank) with validation, per-rank queries and a digest the CP ranks
//! exchange at group setup so that a rank started from a different map is refused before it stores
//! or sends any KV.

use std::ops::Range;

use xxhash_rust::xxh3::xxh3_64;

use crate::config::LayerSplit;

use super::error::LayerSplitError;

/// A validated owner map for `cp_size` context-parallel ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerMap {
    cp_size: u32,
    owners: Vec<u32>,
}

impl OwnerMap {
    /// Validates `split` for a CP group of `cp_size` ranks: at least one layer, `cp_size ≥ 1`, every
    /// owner `< cp_size` (each layer then has exactly one owner by construction), and every rank owns
    /// at least one layer (a rank with no KV has no place in a LayerSplit group).
    ///
    /// # Errors
    /// [`LayerSplitError::InvalidOwnerMap`].
    pub fn new(split: &LayerSplit, cp_size: u32) -> Result<Self, LayerSplitError> {
        if cp_size == 0 {
            return Err(LayerSplitError::InvalidOwnerMap("cp_size is 0".into()));
        }
        if split.owners.is_empty() {
            return Err(LayerSplitError::InvalidOwnerMap("no layers".into()));
        }
        if u32::try_from(split.owners.len()).is_err() {
            return Err(LayerSplitError::InvalidOwnerMap("too many layers".into()));
        }
        if let Some((layer, owner)) = split
            .owners
            .iter()
            .enumerate()
            .find(|(_, o)| **o >= cp_size)
        {
            return Err(LayerSplitError::InvalidOwnerMap(format!(
                "layer {layer} owned by rank {owner}, outside 0..{cp_size}"
            )));
        }
        if let Some(idle) = (0..cp_size).find(|r| !split.owners.contains(r)) {
            return Err(LayerSplitError::InvalidOwnerMap(format!(
                "rank {idle} owns no layer"
            )));
        }
        Ok(Self {
            cp_size,
            owners: split.owners.clone(),
        })
    }

    /// The balanced contiguous map of [`LayerSplit::contiguous`]: rank `r` owns
    /// `[r·L/C, (r+1)·L/C)`, i.e. ⌊L/C⌋ or ⌈L/C⌉ layers.
    ///
    /// # Errors
    /// [`LayerSplitError::InvalidOwnerMap`] when `cp_size` is 0 or exceeds `layers`.
    pub fn contiguous(layers: u32, cp_size: u32) -> Result<Self, LayerSplitError> {
        let split = LayerSplit::contiguous(layers, cp_size).ok_or_else(|| {
            LayerSplitError::InvalidOwnerMap(format!(
                "cannot split {layers} layers over {cp_size} ranks"
            ))
        })?;
        Self::new(&split, cp_size)
    }

    /// CP size.
    pub fn cp_size(&self) -> u32 {
        self.cp_size
    }

    /// Layers of the model.
    pub fn layers(&self) -> u32 {
        self.owners.len() as u32
    }

    /// Owner of `layer`.
    ///
    /// # Errors
    /// [`LayerSplitError::LayerOutOfRange`].
    pub fn owner(&self, layer: u32) -> Result<u32, LayerSplitError> {
        self.owners
            .get(layer as usize)
            .copied()
            .ok_or(LayerSplitError::LayerOutOfRange {
                layer,
                layers: self.layers(),
            })
    }

    /// Layers owned by `rank`, ascending.
    pub fn owned(&self, rank: u32) -> Vec<u32> {
        self.owners
            .iter()
            .enumerate()
            .filter(|(_, o)| **o == rank)
            .map(|(i, _)| i as u32)
            .collect()
    }

    /// The owned layers of `rank` as maximal contiguous ranges (one range for a contiguous map). Each
    /// range is one L3 key namespace ([`super::l3_key`]).
    pub fn owned_ranges(&self, rank: u32) -> Vec<Range<u32>> {
        let mut out: Vec<Range<u32>> = Vec::new();
        for layer in self.owned(rank) {
            match out.last_mut() {
                Some(r) if r.end == layer => r.end = layer + 1,
                _ => out.push(layer..layer + 1),
            }
        }
        out
    }

    /// Digest of `(cp_size, owners)`, exchanged at group setup (R-LS-1 "validated at init").
    pub fn digest(&self) -> u64 {
        let mut bytes = Vec::with_capacity(4 + 4 * self.owners.len());
        bytes.extend_from_slice(&self.cp_size.to_le_bytes());
        for o in &self.owners {
            bytes.extend_from_slice(&o.to_le_bytes());
        }
        xxh3_64(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_covers_every_layer_once_with_balanced_ranges() {
        for (layers, cp) in [(8, 2), (8, 4), (61, 4), (7, 3), (5, 5)] {
            let m = OwnerMap::contiguous(layers, cp).unwrap();
            let mut seen = vec![0u32; layers as usize];
            for r in 0..cp {
                let owned = m.owned(r);
                let n = owned.len() as u32;
                assert!(
                    n == layers / cp || n == layers.div_ceil(cp),
                    "{layers}/{cp}"
                );
                assert_eq!(m.owned_ranges(r).len(), 1, "contiguous map = one range");
                for l in owned {
                    seen[l as usize] += 1;
                }
            }
            assert!(seen.iter().all(|c| *c == 1));
        }
    }

    #[test]
    fn invalid_maps_are_rejected_and_digests_differ() {
        assert!(OwnerMap::contiguous(3, 4).is_err());
        assert!(OwnerMap::contiguous(3, 0).is_err());
        let bad = LayerSplit {
            owners: vec![0, 2, 1],
        };
        assert!(matches!(
            OwnerMap::new(&bad, 2),
            Err(LayerSplitError::InvalidOwnerMap(_))
        ));
        let a = OwnerMap::contiguous(8, 2).unwrap();
        let b = OwnerMap::new(
            &LayerSplit {
                owners: vec![0, 1, 0, 1, 0, 1, 0, 1],
            },
            2,
        )
        .unwrap();
        assert_ne!(a.digest(), b.digest());
        assert_eq!(b.owned_ranges(1), vec![1..2, 3..4, 5..6, 7..8]);
        assert_eq!(a.digest(), OwnerMap::contiguous(8, 2).unwrap().digest());
    }
}
