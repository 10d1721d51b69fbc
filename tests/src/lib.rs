//! Nothing but the integration tests (`tests/integration`); their harness is
//! `kvferry_harness`.
