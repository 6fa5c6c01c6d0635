//! Typed indices into the policy's lists: a limit, a plan, an upstream
//! pool and a route each have an id of their own type, so that one can
//! never be taken for another. An id is its item's place in the validated
//! policy's list, and means nothing under another policy.

/// Declares an id type.
macro_rules! id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(u32);

        impl $name {
            /// The id of the item at `index` of its list.
            ///
            /// # Panics
            /// On an index beyond `u32`: the configuration bounds every
            /// list far below it.
            pub fn new(index: usize) -> Self {
                Self(u32::try_from(index).expect("a policy's list is bounded far below 2^32"))
            }

            /// Its place in its list.
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

id!(
    /// A limit, by its place in the policy's `limits`.
    LimitId
);
id!(
    /// A plan, by its place in the policy's `plans`.
    PlanId
);
id!(
    /// An upstream pool, by its place in the policy's `upstreams`.
    PoolId
);
id!(
    /// A route, by its place in the policy's `routes`.
    RouteId
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_is_its_place() {
        assert_eq!(LimitId::new(7).index(), 7);
        assert_eq!(RouteId::new(0), RouteId::default());
        assert_eq!(PlanId::new(3).to_string(), "3");
        assert!(PoolId::new(1) < PoolId::new(2));
    }
}
