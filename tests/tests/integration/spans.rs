//! What an operator reads in the logs: every load runs in a `load` span that names its
//! instance, rank, path and block counts, and what the load logs (a failure's warn line with
//! its kind, the end of a good one) is inside that span, so a failing load is found by the
//! instance it failed for. The node runs in a child process (this binary re-executed) with a
//! global subscriber that captures every span and event: the node's actors log from their
//! own thread, and the failure line is rate-limited per process, so other tests of this
//! binary must not share either. Likewise a peer link: it is made once, in a `peer_link`
//! span naming both ends, and what the handshake logs is inside it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kvferry_actors::{Clock, LoadRequest, NodeError, QueryRequest};

use kvferry_gpu::KvShape;
use kvferry_harness::*;
use kvferry_testkit::KvKind;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

const CHILD_ENV: &str = "KVFERRY_SPANS_CHILD";

/// Field name → value as text (`Display` values as displayed, strings bare).
#[derive(Clone, Debug, Default)]
struct Fields(BTreeMap<String, String>);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().into(), format!("{value:?}"));
    }
}

/// One span an event was inside.
#[derive(Clone, Debug)]
struct SpanSeen {
    name: &'static str,
    fields: Fields,
}

/// One event with the spans it was inside, innermost first.
#[derive(Clone, Debug)]
struct EventSeen {
    level: Level,
    fields: Fields,
    scope: Vec<SpanSeen>,
}

impl EventSeen {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields.0.get(name).map(String::as_str)
    }

    /// The `load` spans around this event.
    fn loads(&self) -> Vec<&Fields> {
        self.scope
            .iter()
            .filter(|s| s.name == "load")
            .map(|s| &s.fields)
            .collect()
    }
}

/// A layer that keeps every event, with the fields of the spans around it, and every span
/// made.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<EventSeen>>>, Arc<Mutex<Vec<SpanSeen>>>);

impl<S> Layer<S> for Capture
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut f = Fields::default();
        attrs.record(&mut f);
        if let Some(span) = ctx.span(id) {
            self.1.lock().unwrap().push(SpanSeen {
                name: span.name(),
                fields: f.clone(),
            });
            span.extensions_mut().insert(f);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(f) = span.extensions_mut().get_mut::<Fields>() {
                values.record(f);
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let scope = ctx
            .event_scope(event)
            .map(|scope| {
                scope
                    .map(|s| SpanSeen {
                        name: s.name(),
                        fields: s.extensions().get::<Fields>().cloned().unwrap_or_default(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        self.0.lock().unwrap().push(EventSeen {
            level: *event.metadata().level(),
            fields,
            scope,
        });
    }
}

/// The events with message `message`.
fn events(seen: &Capture, message: &str) -> Vec<EventSeen> {
    seen.0
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.field("message") == Some(message))
        .cloned()
        .collect()
}

/// Asserts that `span` is the load span of `instance` rank 0 on the local path over
/// `blocks` blocks, none remote (other fields it may carry are not looked at).
fn assert_load_span(span: &Fields, instance: &str, blocks: usize) {
    let want = [
        ("instance", instance.to_string()),
        ("rank", "0".into()),
        ("path", "local".into()),
        ("blocks", blocks.to_string()),
        ("remote_blocks", "0".into()),
    ];
    for (k, v) in want {
        assert_eq!(span.0.get(k), Some(&v), "the load span's {k}: {span:?}");
    }
}

/// The child half of `a_load_and_its_failure_line_are_inside_a_span_naming_the_load`.
#[test]
#[ignore = "runs only as the child process started by a_load_and_its_failure_line_are_inside_a_span_naming_the_load"]
fn child_load_spans() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let seen = Capture::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(seen.clone()))
        .expect("the only subscriber of this process");
    rt().block_on(async {
        let (node, dev) = node(64 << 10, 8, Clock::system());
        let shape = KvShape::new(2, 1, 2, 1024).unwrap();
        let good = register(&node, &dev, "spans-ok", shape, 0, KvKind::Split, 8, 0).await;
        let bad = register(&node, &dev, "spans-bad", shape, 0, KvKind::Split, 8, 0).await;
        put(&node, "spans-ok", &shape, 0, 0..3).await;
        let query = |inst: &'static str, n: u64| {
            node.query(QueryRequest {
                instance: id(inst),
                hashes: hashes(0..n),
                direct_gpu: false,
                tenant: None,
            })
        };
        let load = |inst: &'static str, lease, dest: &[u32]| {
            node.load(LoadRequest {
                lease,
                instance: id(inst),
                rank: 0,
                dest_blocks: dest.to_vec(),
                per_layer: false,
            })
        };

        // A good load of three blocks into "spans-ok".
        let q = query("spans-ok", 3).await.unwrap();
        let r = load("spans-ok", q.lease.unwrap(), &[5, 1, 7])
            .await
            .unwrap();
        good.verify(&[(5, 0), (1, 1), (7, 2)], 0).unwrap();
        // A failing load of two blocks into "spans-bad": its KV freed under it.
        let q = query("spans-bad", 2).await.unwrap();
        drop(bad);
        let err = load("spans-bad", q.lease.unwrap(), &[0, 1])
            .await
            .unwrap_err();
        assert!(matches!(err, NodeError::Transfer { .. }), "{err}");
        settled(&node).await;

        // The failure's warn line, with its kind, inside the failing load's span only.
        let failed = events(&seen, "transfer failed");
        let warn: Vec<_> = failed.iter().filter(|e| e.level == Level::WARN).collect();
        assert_eq!(
            warn.len(),
            1,
            "one warn line for the failed load: {failed:?}"
        );
        let warn = warn[0];
        assert_eq!(
            (warn.field("kind"), warn.field("path")),
            (Some("Transfer"), Some("local")),
            "{warn:?}"
        );
        let spans = warn.loads();
        assert_eq!(spans.len(), 1, "inside one load span: {warn:?}");
        assert_load_span(spans[0], "spans-bad", 2);
        // The good load's end is logged in its own span, with what it moved.
        let done = events(&seen, "transfer done");
        assert_eq!(done.len(), 1, "{done:?}");
        assert_eq!(done[0].field("bytes"), Some(r.bytes.to_string().as_str()));
        let spans = done[0].loads();
        assert_eq!(spans.len(), 1, "inside one load span: {:?}", done[0]);
        assert_load_span(spans[0], "spans-ok", 3);

        // The next load works.
        let q = query("spans-ok", 3).await.unwrap();
        load("spans-ok", q.lease.unwrap(), &[0, 2, 4])
            .await
            .unwrap();
        good.verify(&[(5, 0), (1, 1), (7, 2), (0, 0), (2, 1), (4, 2)], 0)
            .unwrap();
        settled(&node).await;
        node.shutdown();
    });
    println!("LOAD SPANS OK");
}

/// Every load runs in a span naming its instance, rank, path and blocks; a failed load's warn
/// line (with the error's kind) and a good load's end are each inside their own load's span.
#[test]
fn a_load_and_its_failure_line_are_inside_a_span_naming_the_load() {
    let child = ChildTest::spawn(
        concat!(module_path!(), "::child_load_spans"),
        &[(CHILD_ENV, "1")],
    );
    child.finish(Some("LOAD SPANS OK"));
}

const LINK_CHILD_ENV: &str = "KVFERRY_SPANS_LINK_CHILD";

/// The child half of `a_peer_link_is_made_once_in_a_span_naming_both_ends`.
#[test]
#[ignore = "runs only as the child process started by a_peer_link_is_made_once_in_a_span_naming_both_ends"]
fn child_peer_link_spans() {
    use kvferry_actors::peer::Provider;
    if std::env::var_os(LINK_CHILD_ENV).is_none() {
        return;
    }
    let seen = Capture::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(seen.clone()))
        .expect("the only subscriber of this process");
    rt().block_on(async {
        let shape = KvShape::new(2, 1, 2, 1024).unwrap();
        // Owner "a" holds 0..6 and serves its pool over tcp.
        let owner_peers = grpc_peers("a", Provider::Tcp, "t", &[], None);
        let mut cfg = config(64 << 10, 16);
        cfg.node_id = "a".into();
        let (owner, owner_dev) = start(cfg, Clock::system(), Some(Arc::clone(&owner_peers)));
        let _okv =
            register_ranks(&owner, &owner_dev, "eng", shape, KvKind::Split, 8, 0, 0..6).await;
        let backend = owner
            .peer_backend()
            .with_endpoint(owner_peers.data_endpoint().expect("a tcp data side"));
        let server = PeerServer::start(backend, "t").await;
        // Requester "b" reads the remote suffix from it.
        let peers = grpc_peers(
            "b",
            Provider::Tcp,
            "t",
            &[("a", server.addr.to_string())],
            None,
        );
        let mut cfg = config(64 << 10, 16);
        cfg.node_id = "b".into();
        let (node, dev) = start(cfg, Clock::system(), Some(peers));
        let kv = register(&node, &dev, "eng", shape, 0, KvKind::Split, 16, 0).await;
        let q = query(&node, "eng", 0..4, false).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (0, 4));
        load(&node, q.lease.unwrap(), "eng", 0, &[9, 2, 5, 0])
            .await
            .unwrap();
        kv.verify(&expected(&[9, 2, 5, 0], 0), 0).unwrap();
        let q = query(&node, "eng", 0..6, false).await;
        assert_eq!((q.local_blocks, q.remote_blocks), (4, 2));
        load(&node, q.lease.unwrap(), "eng", 0, &[9, 2, 5, 0, 7, 8])
            .await
            .unwrap();
        kv.verify(&expected(&[9, 2, 5, 0, 7, 8], 0), 0).unwrap();
        settled(&node).await;
        settled_with_peers(&owner).await;

        // One link, made once in a span naming both ends: the second load reused it.
        let links: Vec<Fields> = seen
            .1
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.name == "peer_link")
            .map(|s| s.fields.clone())
            .collect();
        assert_eq!(links.len(), 1, "{links:?}");
        let ends = |f: &Fields| (f.0.get("node").cloned(), f.0.get("peer").cloned());
        let b_to_a = (Some("b".to_string()), Some("a".to_string()));
        assert_eq!(ends(&links[0]), b_to_a, "{links:?}");
        // What the link logs while it is made (the owner's incarnation) is inside it.
        let hs = events(&seen, "peer handshake");
        assert_eq!(hs.len(), 1, "{hs:?}");
        assert_eq!(hs[0].field("provider"), Some("tcp"), "{hs:?}");
        assert!(hs[0].field("incarnation").is_some(), "{hs:?}");
        let around: Vec<_> = hs[0]
            .scope
            .iter()
            .filter(|s| s.name == "peer_link")
            .collect();
        assert_eq!(around.len(), 1, "{hs:?}");
        assert_eq!(ends(&around[0].fields), b_to_a);
        // The line that says it is up names both ends too.
        let up = events(&seen, "peer linked");
        assert_eq!(up.len(), 1, "{up:?}");
        assert_eq!(
            (
                up[0].field("node"),
                up[0].field("peer"),
                up[0].field("provider")
            ),
            (Some("b"), Some("a"), Some("tcp"))
        );
        // Each remote load ends in its own span, which counts its remote blocks.
        let done = events(&seen, "transfer done");
        let remote: Vec<Option<&str>> = done
            .iter()
            .map(|e| {
                let loads = e.loads();
                assert_eq!(loads.len(), 1, "{e:?}");
                assert_eq!(loads[0].0.get("path").map(String::as_str), Some("staged"));
                loads[0].0.get("remote_blocks").map(String::as_str)
            })
            .collect();
        assert_eq!(remote, [Some("4"), Some("2")], "{done:?}");
        node.shutdown();
        server.stop().await;
        owner.shutdown();
    });
    println!("PEER LINK SPANS OK");
}

/// A peer link is made once per owner, in a `peer_link` span naming both ends; the
/// handshake's line (the owner's incarnation) is inside it, and the remote loads that use it
/// each run in their own load span.
#[test]
fn a_peer_link_is_made_once_in_a_span_naming_both_ends() {
    let child = ChildTest::spawn(
        concat!(module_path!(), "::child_peer_link_spans"),
        &[(LINK_CHILD_ENV, "1")],
    );
    child.finish(Some("PEER LINK SPANS OK"));
}
