//! kvferry transport: memory regions, remote descriptors and one-sided read providers.
