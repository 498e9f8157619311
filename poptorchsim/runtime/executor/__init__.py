"""runtime/executor/: PoplarExecutor, what trainingModel and inferenceModel
return, and the parts it is built from."""
