//! The cache's eviction order: lists (one per class, and one per class and namespace
//! under a quota), each doubly linked through pool slot indices, oldest first.
//!
//! A block leaves the list when it is pinned and comes back at the young end when its last
//! pin goes. A query pins every block of its prefix and its release unpins them, so both
//! are O(1) without allocation here (an ordered map of ticks cost a tree insert and remove
//! per block and per query).

const NIL: usize = usize::MAX;

#[derive(Clone)]
struct Link<K> {
    prev: usize,
    next: usize,
    /// The block in this slot while it is listed.
    key: Option<K>,
    class: usize,
}

impl<K> Default for Link<K> {
    fn default() -> Self {
        Self {
            prev: NIL,
            next: NIL,
            key: None,
            class: 0,
        }
    }
}

/// LRU lists over slot indices; a slot is in at most one of them. A list index past the
/// last list reads as an empty list (and pushing to it adds the lists up to it).
pub struct SlotLru<K> {
    links: Vec<Link<K>>,
    head: Vec<usize>,
    tail: Vec<usize>,
    len: Vec<usize>,
}

impl<K: Clone> SlotLru<K> {
    /// `lists` empty lists.
    pub fn with_lists(lists: usize) -> Self {
        Self {
            links: Vec::new(),
            head: vec![NIL; lists],
            tail: vec![NIL; lists],
            len: vec![0; lists],
        }
    }

    pub fn len(&self, class: usize) -> usize {
        self.len.get(class).copied().unwrap_or(0)
    }

    /// Lists `slot` (holding `key`) as the youngest of `class`; a slot already listed moves.
    pub fn push_young(&mut self, class: usize, slot: usize, key: K) {
        self.remove(slot);
        if class >= self.head.len() {
            self.head.resize(class + 1, NIL);
            self.tail.resize(class + 1, NIL);
            self.len.resize(class + 1, 0);
        }
        if slot >= self.links.len() {
            self.links.resize_with(slot + 1, Link::default);
        }
        let tail = self.tail[class];
        self.links[slot] = Link {
            prev: tail,
            next: NIL,
            key: Some(key),
            class,
        };
        match tail {
            NIL => self.head[class] = slot,
            t => self.links[t].next = slot,
        }
        self.tail[class] = slot;
        self.len[class] += 1;
    }

    /// Unlists `slot`; returns its key if it was listed.
    pub fn remove(&mut self, slot: usize) -> Option<K> {
        let link = self.links.get_mut(slot)?;
        let key = link.key.take()?;
        let (prev, next, class) = (link.prev, link.next, link.class);
        link.prev = NIL;
        link.next = NIL;
        match prev {
            NIL => self.head[class] = next,
            p => self.links[p].next = next,
        }
        match next {
            NIL => self.tail[class] = prev,
            n => self.links[n].prev = prev,
        }
        self.len[class] -= 1;
        Some(key)
    }

    /// Unlists and returns the oldest slot of `class`.
    pub fn pop_oldest(&mut self, class: usize) -> Option<(usize, K)> {
        let slot = *self.head.get(class)?;
        if slot == NIL {
            return None;
        }
        self.remove(slot).map(|k| (slot, k))
    }

    /// The slots of `class`, oldest first.
    #[cfg(test)]
    pub fn iter(&self, class: usize) -> impl Iterator<Item = (usize, &K)> + '_ {
        let mut at = self.head.get(class).copied().unwrap_or(NIL);
        std::iter::from_fn(move || {
            if at == NIL {
                return None;
            }
            let link = &self.links[at];
            let out = (at, link.key.as_ref()?);
            at = link.next;
            Some(out)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(l: &SlotLru<u32>, class: usize) -> Vec<usize> {
        l.iter(class).map(|(s, _)| s).collect()
    }

    #[test]
    fn oldest_first_per_class_and_moves_on_push() {
        let mut l: SlotLru<u32> = SlotLru::with_lists(2);
        l.push_young(0, 5, 50);
        l.push_young(0, 2, 20);
        l.push_young(1, 9, 90);
        l.push_young(0, 7, 70);
        assert_eq!(order(&l, 0), vec![5, 2, 7]);
        assert_eq!(order(&l, 1), vec![9]);
        // Pushing a listed slot again moves it to the young end (of its new class).
        l.push_young(1, 5, 51);
        assert_eq!(order(&l, 0), vec![2, 7]);
        assert_eq!(order(&l, 1), vec![9, 5]);
        assert_eq!((l.len(0), l.len(1)), (2, 2));
        assert_eq!(l.pop_oldest(1), Some((9, 90)));
        assert_eq!(l.pop_oldest(1), Some((5, 51)));
        assert_eq!(l.pop_oldest(1), None);
    }

    #[test]
    fn remove_from_the_middle_and_the_ends_keeps_the_links() {
        let mut l: SlotLru<u32> = SlotLru::with_lists(2);
        for s in 0..5 {
            l.push_young(0, s, s as u32);
        }
        assert_eq!(l.remove(2), Some(2));
        assert_eq!(l.remove(2), None);
        assert_eq!(l.remove(0), Some(0));
        assert_eq!(l.remove(4), Some(4));
        assert_eq!(l.remove(99), None);
        assert_eq!(order(&l, 0), vec![1, 3]);
        l.push_young(0, 0, 0);
        assert_eq!(order(&l, 0), vec![1, 3, 0]);
        assert_eq!(l.pop_oldest(0), Some((1, 1)));
        assert_eq!(l.pop_oldest(0), Some((3, 3)));
        assert_eq!(l.pop_oldest(0), Some((0, 0)));
        assert_eq!(l.len(0), 0);
        assert_eq!(l.pop_oldest(0), None);
    }

    #[test]
    fn lists_past_the_last_are_empty_until_pushed() {
        let mut l: SlotLru<u32> = SlotLru::with_lists(0);
        assert_eq!((l.len(7), l.pop_oldest(7)), (0, None));
        l.push_young(7, 3, 30);
        l.push_young(2, 4, 40);
        assert_eq!((l.len(7), l.len(2), l.len(5)), (1, 1, 0));
        assert_eq!(order(&l, 7), vec![3]);
        assert_eq!(l.pop_oldest(7), Some((3, 30)));
        assert_eq!(l.remove(4), Some(40));
    }
}
