"""The cluster a command takes: the resource spec's model (``model``), loading it from YAML with
every value's position (``load``, ``yamlpos``), and the other inputs that become a spec: Ansible
inventories (``inventory``), DeepSpeed hostfiles (``hostfile``, ``deepspeed``), and the choice
between them (``loading``)."""
