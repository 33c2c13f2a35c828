//! ptl-autograd (in progress)
