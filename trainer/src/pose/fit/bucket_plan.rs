//! The target bucket a fit lays its recorded steps' arenas out for: the largest its data can give.
//!
//! The dense criterion pads each batch's targets to a bucket of slots per image, and a replay
//! plugin records one step shape per bucket into arenas the buckets share (they take turns). A
//! bucket larger than every recorded one would have to grow those arenas mid-fit. So, just before
//! the step plugin's first recording, the fit has it record a step with the targets padded to the
//! largest bucket the training data can give, without running it
//! ([`crate::fit::ReplayPlugin::prepare`]): the arenas are laid out for that shape, and every
//! bucket recorded later is smaller and fits them. Nothing of the prepared step runs, so no byte
//! of the fit changes; its cost is the memory the largest bucket needs, held from the first
//! recording on instead of from the step that first needs it.

use ptl_data::PoseDataset;

use crate::fit::{PluginStack, Site};
use crate::loss::assign_dense::{target_bucket, TARGET_BUCKETS};

/// The most objects one training sample can hold: a mosaic joins the sample's image and three
/// partners drawn with replacement, so up to four copies of the most crowded image.
pub(crate) fn most_objects_per_sample(ds: &PoseDataset, mosaic: bool) -> usize {
    let most = ds.items.iter().map(|it| it.labels.cls.len()).max().unwrap_or(0);
    if mosaic {
        4 * most
    } else {
        most
    }
}

/// When to prepare the planned step, and what was prepared.
#[derive(Debug)]
pub(super) struct BucketPlan {
    /// Objects per image of the planned step (capped at the largest bucket: a batch beyond it
    /// takes the host path whatever the plan).
    objects: usize,
    /// Calls of the step site so far in this process.
    calls: usize,
    /// The slots of the step prepared, once one was.
    prepared: Option<usize>,
}

impl BucketPlan {
    /// A plan for data whose samples hold at most `most_objects` objects.
    pub(super) fn new(most_objects: usize) -> BucketPlan {
        let largest = TARGET_BUCKETS[TARGET_BUCKETS.len() - 1];
        BucketPlan { objects: most_objects.min(largest), calls: 0, prepared: None }
    }

    /// Counts a call of the step site and says whether the planned step is to be prepared before
    /// it: `Some(objects)` when it is the call that makes the claimant's first recording (after
    /// its warm-up calls) and the plan's bucket is larger than `own_slots`, the call's own.
    pub(super) fn due(&mut self, plugins: &PluginStack, own_slots: usize) -> Option<usize> {
        let first_recording = plugins.calls_before_recording(Site::ForwardLoss)?;
        let now = self.calls;
        self.calls += 1;
        let larger = target_bucket(self.objects).is_some_and(|slots| slots > own_slots);
        (now == first_recording && larger).then_some(self.objects)
    }

    /// Notes that a step with `slots` target slots per image was prepared.
    pub(super) fn prepared(&mut self, slots: usize) {
        self.prepared = Some(slots);
    }

    /// The slots of the prepared step, if one was.
    pub(super) fn prepared_slots(&self) -> Option<usize> {
        self.prepared
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step plugin that records its first shape at its second call.
    #[derive(Clone)]
    struct RecordsSecond;

    impl crate::fit::ReplayPlugin for RecordsSecond {
        fn name(&self) -> &'static str {
            "records-second"
        }
        fn claims(&self, site: Site) -> bool {
            site == Site::ForwardLoss
        }
        fn calls_before_recording(&self, site: Site) -> Option<usize> {
            (site == Site::ForwardLoss).then_some(1)
        }
    }

    /// The plan's count is capped at the largest bucket (a batch beyond it takes the host path).
    #[test]
    fn the_planned_count_is_capped_at_the_largest_bucket() {
        assert_eq!(BucketPlan::new(1000).objects, 256);
        assert_eq!(BucketPlan::new(12).objects, 12);
    }

    /// The planned step is prepared once, before the call that records first, and only when its
    /// bucket is larger than that call's own; without a claimant, never.
    #[test]
    fn the_plan_is_due_before_the_first_recording_only() {
        let stack = PluginStack::new(vec![Box::new(RecordsSecond)]);
        let mut plan = BucketPlan::new(40);
        let due: Vec<Option<usize>> = (0..4).map(|_| plan.due(&stack, 16)).collect();
        assert_eq!(due, vec![None, Some(40), None, None]);
        let mut same = BucketPlan::new(40);
        assert_eq!((0..3).map(|_| same.due(&stack, 64)).collect::<Vec<_>>(), vec![None, None, None], "already the largest bucket");
        let mut alone = BucketPlan::new(40);
        assert_eq!(alone.due(&PluginStack::default(), 8), None);
        assert_eq!(alone.due(&PluginStack::default(), 8), None);
    }
}
