"""Video: the Wan options and policy builder the video pipelines share (`wan`), Edit-GRPO (`video_edit`),
VGGRPO (`video_geometry`) and Euphonium with its process-reward guidance (`euphonium`, `guidance`)."""
