//! kvferry-actors
