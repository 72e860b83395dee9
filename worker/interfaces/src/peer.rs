//! The peer protocol between workers (worker/interfaces/README.md §6): gRPC package
//! `tandem.transfer.v1`, compiled from `proto/tandem/transfer/v1/transfer.proto` by protox in
//! `build.rs` (no `protoc`).
//!
//! Only the message types are generated here (prost, no tonic): the worker's `build.rs` generates
//! the tonic client and server over them (`extern_path`) and its `control::pb` re-exports both,
//! so there is one copy of every message.

/// Generated protobuf message types.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/tandem.transfer.v1.rs"));
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::pb;

    #[test]
    fn room_refs_round_trip_on_the_wire() {
        let r = pb::RoomRef {
            room_id: 7,
            generation: 3,
        };
        let bytes = r.encode_to_vec();
        assert_eq!(pb::RoomRef::decode(bytes.as_slice()).unwrap(), r);
        // A message of another shape is not silently a RoomRef with zeroes: a wrong wire type is
        // a decode error.
        assert!(pb::RoomRef::decode(&[0x0a, 0x01, 0x00][..]).is_err());
    }
}
