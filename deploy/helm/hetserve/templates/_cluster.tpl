{{/* The RayCluster spec, shared by the RayCluster and the (experimental) RayService. */}}
{{- define "hetserve.clusterSpec" -}}
{{- $v := .Values -}}
{{- $isRay := eq $v.hetserve.executor "ray" -}}
{{- $image := include "hetserve.image" $v.image -}}
rayVersion: {{ $v.rayVersion | quote }}
enableInTreeAutoscaling: false
{{- if and $v.upgradeStrategy (not $v.rayService.enabled) }}
upgradeStrategy:
  type: {{ $v.upgradeStrategy }}
{{- end }}
headGroupSpec:
  serviceType: ClusterIP
  rayStartParams:
    {{- $headParams := deepCopy $v.head.rayStartParams }}
    {{- if $isRay }}{{ $_ := set $headParams "num-cpus" (get $headParams "num-cpus" | default "0") }}{{ end }}
    {{- toYaml $headParams | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "hetserve.componentSelector" (dict "ctx" . "component" "head") | nindent 8 }}
      annotations:
        # a config change gives the head a new template, which upgradeStrategy Recreate rolls out
        checksum/config: {{ include "hetserve.config" . | sha256sum }}
    spec:
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $v.podSecurityContext | nindent 8 }}
      {{- with include "hetserve.scheduling" $v.head | trim }}{{ . | nindent 6 }}{{ end }}
      initContainers:
        {{- include "hetserve.prepareModel" (dict "ctx" . "image" $image "resources" $v.head.resources) | nindent 8 }}
      containers:
        - name: ray-head
          image: {{ $image }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          command: ["/bin/bash", "-c", "--"]
          args:
            - |
              set -euo pipefail
              ulimit -n 65536 || echo "could not raise the open-files limit to 65536" >&2
              {{- if $isRay }}
              # KubeRay's generated `ray start --head` without --block: hetserve, not Ray, owns the container
              eval "${KUBERAY_GEN_RAY_START_CMD/--block/}"
              {{- end }}
              exec hetserve serve --config {{ include "hetserve.configPath" . }}{{ range $v.hetserve.extraArgs }} {{ . | quote }}{{ end }}
          ports:
            - {name: http, containerPort: {{ $v.hetserve.port }}, protocol: TCP}
            {{- if $isRay }}
            - {name: gcs-server, containerPort: 6379, protocol: TCP}
            - {name: dashboard, containerPort: 8265, protocol: TCP}
            - {name: client, containerPort: 10001, protocol: TCP}
            {{- end }}
          env:
            {{- if $v.apiKey.existingSecret }}
            - name: HETSERVE_API_KEY
              valueFrom:
                secretKeyRef:
                  name: {{ $v.apiKey.existingSecret }}
                  key: {{ $v.apiKey.key }}
            {{- end }}
            - {name: NUMBA_CACHE_DIR, value: {{ printf "%s/numba" $v.modelCache.mountPath | quote }}}
            - {name: RAY_worker_niceness, value: "0"}  # actors at normal priority (Ray's default is 15)
            {{- with $v.hetserve.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            {{- toYaml $v.head.resources | nindent 12 }}
          securityContext:
            {{- toYaml $v.securityContext | nindent 12 }}
          startupProbe:
            httpGet: {path: /health, port: http}
            {{- toYaml $v.head.startupProbe | nindent 12 }}
          readinessProbe:
            httpGet: {path: /health, port: http}
            {{- toYaml $v.head.readinessProbe | nindent 12 }}
          livenessProbe:
            httpGet: {path: /health, port: http}
            {{- toYaml $v.head.livenessProbe | nindent 12 }}
          volumeMounts:
            - name: config
              mountPath: {{ dir (include "hetserve.configPath" .) }}
              readOnly: true
            - name: model-cache
              mountPath: {{ $v.modelCache.mountPath }}
      volumes:
        - name: config
          configMap:
            name: {{ include "hetserve.fullname" . }}
        {{- include "hetserve.cacheVolume" . | nindent 8 }}
{{- if $isRay }}
workerGroupSpecs:
  {{- if $v.gpuWorkers.enabled }}
  {{- $g := $v.gpuWorkers }}
  {{- $gpuImage := include "hetserve.image" (dict "repository" ($g.image.repository | default $v.image.repository) "tag" $g.image.tag) }}
  {{- $gpuResources := deepCopy $g.resources }}
  {{- $_ := set $gpuResources.limits "nvidia.com/gpu" ($g.gpusPerPod | toString) }}
  {{- $gpuParams := deepCopy $g.rayStartParams }}
  {{- $_ := set $gpuParams "num-gpus" ($g.gpusPerPod | toString) }}
  - groupName: {{ $g.groupName }}
    replicas: {{ $g.replicas }}
    minReplicas: {{ $g.replicas }}
    maxReplicas: {{ $g.replicas }}
    rayStartParams:
      {{- toYaml $gpuParams | nindent 6 }}
    template:
      {{- include "hetserve.workerTemplate" (dict "ctx" . "component" "gpu-worker" "image" $gpuImage "group" $g "resources" $gpuResources "model" true) | nindent 6 }}
  {{- end }}
  {{- $c := $v.cpuAttention }}
  {{- $cpuParams := deepCopy $c.rayStartParams }}
  {{- $_ := set $cpuParams "num-cpus" (mul $c.actorsPerPod $c.cpusPerActor | toString) }}
  {{- $_ := set $cpuParams "resources" (printf "'%s'" (dict $c.kvResource $c.actorsPerPod | toJson)) }}
  {{- $cpu := add (mul $c.actorsPerPod $c.cpusPerActor) $c.extraCPUs | toString }}
  {{- $memory := printf "%dGi" (int (add (mul $c.actorsPerPod $c.kvCacheGiBPerActor) $c.memoryOverheadGiB)) }}
  {{- $cpuResources := dict "requests" (dict "cpu" $cpu "memory" $memory) "limits" (dict "cpu" $cpu "memory" $memory) }}
  - groupName: {{ $c.groupName }}
    replicas: {{ $c.replicas }}
    minReplicas: {{ $c.replicas }}
    maxReplicas: {{ $c.replicas }}
    rayStartParams:
      {{- toYaml $cpuParams | nindent 6 }}
    template:
      {{- include "hetserve.workerTemplate" (dict "ctx" . "component" "cpu-attention" "image" $image "group" $c "resources" $cpuResources "model" false) | nindent 6 }}
{{- end }}
{{- end }}

{{/* A worker pod template: `ray start` in the foreground, raylet probes. Where the model actor may run
     (.model), an init container prepares the model cache; it gets the group's resources without the GPU. */}}
{{- define "hetserve.workerTemplate" -}}
{{- $v := .ctx.Values -}}
metadata:
  labels:
    {{- include "hetserve.componentSelector" (dict "ctx" .ctx "component" .component) | nindent 4 }}
spec:
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  {{- with include "hetserve.scheduling" .group | trim }}{{ . | nindent 2 }}{{ end }}
  {{- if .model }}
  initContainers:
    {{- include "hetserve.prepareModel" (dict "ctx" .ctx "image" .image "resources" .group.resources) | nindent 4 }}
  {{- end }}
  containers:
    - name: ray-worker
      image: {{ .image }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command: ["/bin/bash", "-c", "--"]
      args:
        - |
          ulimit -n 65536 || echo "could not raise the open-files limit to 65536" >&2
          eval "exec $KUBERAY_GEN_RAY_START_CMD"
      env:
        - {name: NUMBA_CACHE_DIR, value: {{ printf "%s/numba" $v.modelCache.mountPath | quote }}}
        - {name: RAY_worker_niceness, value: "0"}  # actors at normal priority (Ray's default is 15)
      resources:
        {{- toYaml .resources | nindent 8 }}
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      readinessProbe:
        {{- include "hetserve.rayletProbe" . | nindent 8 }}
      livenessProbe:
        {{- include "hetserve.rayletProbe" . | nindent 8 }}
      volumeMounts:
        - name: model-cache
          mountPath: {{ $v.modelCache.mountPath }}
  volumes:
    {{- include "hetserve.cacheVolume" .ctx | nindent 4 }}
{{- end }}
